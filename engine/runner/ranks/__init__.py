"""The processes of a replica that spans several ranks: the driver side (executor.py) and each rank (worker.py).

Only engine/core/llm_engine.py starts them; the split itself (who holds what) and the collectives live one level
down, in engine/parallel/.
"""
