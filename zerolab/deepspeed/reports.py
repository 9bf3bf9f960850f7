"""What DeepSpeed's engine reports about its steps, for the adapter (``engine.py``) to inherit.

``get_global_grad_norm()``: the global gradient norm of the last optimizer
step, *before* clipping and unscaled by the fp16 loss scale -- what DeepSpeed
0.19.8's ZeRO optimizers (and its fp16/bf16 wrappers) store; its fp32 ZeRO-0
path keeps a plain torch optimizer, which stores none, so there it is None, as
here. zerolab's engine computes the norm inside ``step()`` when it clips, and
when ``engine.report_grad_norm`` asks it to (set by ``reports_grad_norm`` for
the engines DeepSpeed reports a norm for): ``engine.last_grad_norm`` is the
number reported. ``was_step_applied()``:
whether the last ``step()`` updated the parameters (False between accumulation
boundaries and after an fp16 overflow skipped the step). Also
``get_batch_info()``, ``optimizer_name()`` and ``save_fp16_model`` (the old name
of ``save_16bit_model``), as DeepSpeed answers them; ``zero_gather_16bit_weights_on_model_save()`` and
``_zero3_consolidated_16bit_state_dict()``, which Accelerate calls to save a ZeRO-3 model.
"""
from __future__ import annotations

from zerolab.engine.checkpoint.state import gather_state_dict


def reports_grad_norm(engine) -> bool:
    """Whether DeepSpeed reports a norm for this engine: all but fp32 ZeRO-0 (a plain torch optimizer)."""
    return not (engine.stage == 0 and engine.scaler is None and not engine.config.bf16_enabled)


class StepReports:
    def _before_step(self):
        e, d = self.engine, self.__dict__
        d["_boundary_now"], d["_skipped_before"] = (e.micro_steps + 1) % e.gas == 0, e.skipped_steps

    def _after_step(self):
        d = self.__dict__
        d["_step_applied"] = d.get("_boundary_now", False) and self.engine.skipped_steps == d["_skipped_before"]
        if d.get("_boundary_now") and self.engine.report_grad_norm:   # DeepSpeed reports inf for an overflow
            d["_global_grad_norm"] = self.engine.last_grad_norm if d["_step_applied"] else float("inf")

    def get_global_grad_norm(self):
        """The last optimizer step's gradient norm before clipping (None before the first, and at fp32 ZeRO-0)."""
        return self.__dict__.get("_global_grad_norm")

    def was_step_applied(self) -> bool:
        return self.__dict__.get("_step_applied", False)

    def get_batch_info(self):
        """The three numbers DeepSpeed's docstring promises (its 0.19.8 code returns the bound methods)."""
        return self.train_batch_size(), self.train_micro_batch_size_per_gpu(), self.gradient_accumulation_steps()

    def optimizer_name(self):
        """DeepSpeed: the client optimizer's class name, else the config's type in lower case."""
        client = self.__dict__.get("client_optimizer_name")
        return client or (self.engine.config.optimizer.type if self.optimizer is not None else None)

    def save_fp16_model(self, save_dir, save_filename="pytorch_model.bin"):
        return self.save_16bit_model(save_dir, save_filename)

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        """The config's ``stage3_gather_16bit_weights_on_model_save`` (or its other names; DeepSpeed's default
        False): whether a library may ask for the consolidated 16-bit weights (Accelerate, Trainer.save_model)."""
        zero = self.config.get("zero_optimization") or {} if isinstance(self.config, dict) else {}
        names = ("stage3_gather_16bit_weights_on_model_save", "gather_16bit_weights_on_model_save",
                 "stage3_gather_fp16_weights_on_model_save")
        return bool(next((zero[k] for k in names if k in zero), False))

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters=False):
        """Collective: the whole model in the compute dtype on rank 0 (None elsewhere), gathered a unit at a
        time — what ``save_16bit_model`` writes; the name transformers and Accelerate call."""
        sd = gather_state_dict(self.engine, rank0_only=True, sixteen_bit=True, exclude_frozen=exclude_frozen_parameters)
        return sd if self.engine.rank == 0 else None


class GradNormHook:
    """The zerolab engine as zerolab's pipeline drives it, with the reports around each step."""

    def __init__(self, ds):
        self.__dict__["ds"] = ds

    def __getattr__(self, name):
        return getattr(self.ds.engine, name)

    def __setattr__(self, name, value):   # zerolab's pipeline sets pipeline_stats on the engine it drives
        setattr(self.ds.engine, name, value)

    def __call__(self, *inputs, **kwargs):
        return self.ds.engine(*inputs, **kwargs)

    def step(self):
        self.ds._before_step()
        self.ds.engine.step()
        self.ds._after_step()
