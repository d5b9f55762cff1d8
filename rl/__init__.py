"""On-policy RL on Detent: GRPO with the engine as the rollout worker and
`TrainerModel` (the engine's model with gradients) as the policy.

    from detent.engine import LLM
    from detent.rl import GRPOConfig, ArithmeticTask, train_grpo
    llm = LLM(rl=True)
    logs = train_grpo(llm, ArithmeticTask(llm.get_tokenizer()), GRPOConfig(steps=200))

See docs/rl.md.
"""
from detent.rl.grpo import group_advantages, grpo_loss
from detent.rl.loop import GRPOConfig, StepLog, train_grpo
from detent.rl.task import ArithmeticTask, Problem, TargetTokenTask, Task

__all__ = ["ArithmeticTask", "GRPOConfig", "Problem", "StepLog", "TargetTokenTask", "Task", "group_advantages",
           "grpo_loss", "train_grpo"]
