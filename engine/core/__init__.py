"""The engine and its scheduler: LLMEngine (llm_engine.py) steps the Scheduler (scheduler.py, with its KV cache
manager: kv_cache_manager.py) and an executor (engine/runner/), and turns tokens into text (output_processor.py,
stop_strings.py); AsyncLLMEngine (async_engine.py) runs it on a thread, Generator (generator.py) drives it for one
request, and resume.py continues a request another replica started."""
