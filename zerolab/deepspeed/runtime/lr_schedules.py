"""``deepspeed.runtime.lr_schedules``: the names of DeepSpeed's config schedules (Accelerate checks a scheduler's
class name against ``VALID_LR_SCHEDULES``); zerolab implements WarmupLR and WarmupDecayLR (engine/optim.py)."""
from zerolab.config.optimizer import SCHEDULER_TYPES

VALID_LR_SCHEDULES = ["LRRangeTest", "OneCycle", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR"]
IMPLEMENTED = SCHEDULER_TYPES
