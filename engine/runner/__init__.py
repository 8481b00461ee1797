"""The runner layer: how the engine's steps reach the model. An Executor (executor.py) runs each step, in this
process (LocalExecutor over a ModelRunner) or on the rank processes of a split replica (ranks/); builder.py builds
the one the engine's configuration asks for. Inside a rank or a one-process replica, the ModelRunner
(model_runner.py) mirrors the scheduler's sequences (sequence_mirror.py), runs the forward pass (how: the model's
step, engine/models/step.py) and samples (sampling_step.py)."""
