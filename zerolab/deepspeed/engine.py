"""The engine ``deepspeed.initialize`` returns: DeepSpeed's methods and properties over a zerolab engine.

``DeepSpeedEngine`` holds the zerolab engine (``zl.initialize``'s) and answers
the calls DeepSpeed scripts make, with DeepSpeed 0.19's signatures, defaults and
return values: ``get_lr()`` is a list (one entry per parameter group),
``train_micro_batch_size_per_gpu()`` is a method, ``save_checkpoint`` returns
True. Anything else is looked up on the zerolab engine (``engine.memory()``,
``engine.comm``, the book's tools) and then on the model, as DeepSpeed forwards
unknown attributes to the model. A DeepSpeed call zerolab cannot honour raises
``NotImplementedError`` naming the nearest zerolab equivalent.
"""
from __future__ import annotations

from contextlib import contextmanager

from zerolab.deepspeed.reports import StepReports, reports_grad_norm
from zerolab.deepspeed.torch_backward import hook_outputs


def _refuse(call: str, instead: str):
    raise NotImplementedError(f"zerolab.deepspeed: {call} is not supported; {instead}")


class DeepSpeedEngine(StepReports):
    def __init__(self, engine, training_dataloader=None, local_rank: int = 0, has_optimizer: bool = True):
        d = self.__dict__   # set directly: __getattr__ forwards only what is not here
        d["engine"], d["training_dataloader"], d["local_rank"] = engine, training_dataloader, local_rank
        d["optimizer"] = DeepSpeedOptimizer(engine) if has_optimizer else None
        d["lr_scheduler"] = DeepSpeedScheduler(self) if engine.scheduler is not None else None
        d["inside_no_sync_ctxt"] = False
        engine.report_grad_norm = reports_grad_norm(engine)   # the step computes it (get_global_grad_norm)

    # ---------------------------------------------------------------- what scripts call every step
    def __call__(self, *inputs, **kwargs):
        out = self.engine(*inputs, **kwargs)
        if self.optimizer is not None:   # loss.backward() then engine.step() works too (torch_backward.py)
            hook_outputs(self.engine, out)
        return out

    forward = __call__

    def backward(self, loss, retain_graph=False, scale_wrt_gas=True):
        """DeepSpeed's: loss / gradient_accumulation_steps, then autograd; returns the scaled loss."""
        self._need_optimizer("backward")
        if retain_graph:
            _refuse("engine.backward(retain_graph=True)", "zerolab's engine.backward(loss) frees the graph")
        if not scale_wrt_gas and self.engine.gas > 1:   # the caller divided already (Trainer): the engine will too
            loss = loss * self.engine.gas
        forced = self.__dict__.pop("_boundary", None)   # set_gradient_accumulation_boundary's, for this backward
        if forced is not None and forced != self.engine.is_gradient_accumulation_boundary():
            raise RuntimeError(f"set_gradient_accumulation_boundary({forced}) at micro-batch {self.engine.micro_steps} "
                               f"disagrees with gradient_accumulation_steps={self.engine.gas} in the config: give "
                               f"the config the accumulation the caller uses (\"auto\" takes it from the Trainer)")
        self.engine.backward(loss)
        if forced is False:   # the caller (Accelerate) calls step() only at the boundary: count the micro-batch
            self.engine.step()
        return loss / self.engine.gas if self.engine.gas > 1 else loss

    def set_gradient_accumulation_boundary(self, is_boundary):
        """DeepSpeed's, as Accelerate (and so Trainer) drives it: the next backward is (not) the boundary, and
        step() comes only at the boundary. zerolab's engine counts micro-batches in step(), so a backward
        outside the boundary counts its own; a boundary the config's accumulation disagrees with is refused."""
        self.__dict__["_boundary"] = bool(is_boundary)

    def step(self, lr_kwargs=None):
        self._need_optimizer("step")
        if lr_kwargs is not None:
            _refuse("engine.step(lr_kwargs=...)", "the config's \"scheduler\" sets the learning rate")
        self._before_step()
        self.engine.step()
        self._after_step()
        if self.was_step_applied() and not isinstance(self.lr_scheduler, DeepSpeedScheduler) and \
                self.lr_scheduler is not None:
            holder = getattr(self.lr_scheduler, "optimizer", None)
            if holder is not None:   # the engine stepped for it (torch warns of a scheduler stepped before its optimizer)
                holder._opt_called = True
            self.lr_scheduler.step()   # a client scheduler: after each applied optimizer step, as DeepSpeed

    def destroy(self):
        """DeepSpeed's: release what the engine holds beyond the model; here the gradient hooks go."""
        self.engine.close()

    def _need_optimizer(self, call):
        if self.optimizer is None:   # DeepSpeed asserts the same
            raise RuntimeError(f"engine.{call}(): must provide an optimizer during init (the config's "
                               f"\"optimizer\" section or deepspeed.initialize(optimizer=...))")

    def train(self, mode=True):
        self.engine.train(mode)
        return self

    def eval(self):
        return self.train(False)

    # ---------------------------------------------------------------- state and configuration
    @property
    def module(self):
        return self.engine.module

    @property
    def device(self):
        return self.engine.flat.device

    @property
    def global_rank(self):
        return self.engine.rank

    @property
    def world_size(self):
        return self.engine.world_size

    dp_world_size = world_size

    @property
    def global_steps(self):
        return self.engine.global_steps

    @property
    def micro_steps(self):
        return self.engine.micro_steps

    @property
    def skipped_steps(self):
        return self.engine.skipped_steps

    @property
    def global_samples(self):
        """Samples consumed by the steps taken (DeepSpeed adds train_batch_size per step)."""
        return self.engine.global_steps * self.train_batch_size()

    def get_lr(self):
        """The learning rate of each parameter group, as DeepSpeed's list (zerolab's own ``get_lr`` is a float)."""
        return group_lrs(self.engine) if self.optimizer else []

    def get_mom(self):
        key = "momentum" if self.engine.config.optimizer.type == "sgd" else "betas"
        return [g[key] for g in self.optimizer.param_groups] if self.optimizer else []

    def zero_optimization_stage(self):
        return self.engine.stage

    def zero_optimization(self):
        return self.engine.stage > 0

    def zero_optimization_partition_gradients(self):
        return self.engine.stage >= 2

    def train_micro_batch_size_per_gpu(self):
        return self.engine.config.train_micro_batch_size_per_gpu

    def train_batch_size(self):
        return self.engine.config.train_batch_size

    def gradient_accumulation_steps(self):
        return self.engine.gas

    def gradient_clipping(self):
        return self.engine.config.gradient_clipping

    def is_gradient_accumulation_boundary(self):
        return self.engine.is_gradient_accumulation_boundary()

    def fp16_enabled(self):
        return self.engine.config.fp16.enabled

    def bfloat16_enabled(self):
        return self.engine.config.bf16_enabled

    def dataloader_drop_last(self):
        return bool(self.training_dataloader and self.training_dataloader.dataloader_drop_last)

    # ---------------------------------------------------------------- checkpoints
    def save_checkpoint(self, save_dir, tag=None, client_state={}, save_latest=True,  # noqa: B006 - DeepSpeed's
                        exclude_frozen_parameters=False, format="zerolab"):
        """DeepSpeed's keywords; ``format="deepspeed"`` writes DeepSpeed's own files (zerolab's engine)."""
        if not save_latest:
            _refuse("save_checkpoint(save_latest=False)", "zerolab always points `latest` at the newest tag")
        self.engine.save_checkpoint(save_dir, tag, dict(client_state or {}), exclude_frozen_parameters, format=format)
        return True

    def load_checkpoint(self, load_dir, tag=None, load_module_strict=True, load_optimizer_states=True,
                        load_lr_scheduler_states=True, load_module_only=False, custom_load_fn=None):
        """``(load_path, client_state)``; ``(None, None)`` when there is no checkpoint, as DeepSpeed."""
        if not load_module_strict or custom_load_fn is not None:
            _refuse("load_checkpoint(load_module_strict=False / custom_load_fn=...)",
                    "zerolab loads every parameter; for a partial model use engine.load_state_dict(sd, strict=False)")
        if load_module_only:
            load_optimizer_states = load_lr_scheduler_states = False
        return self.engine.load_checkpoint(load_dir, tag, load_optimizer_states, load_lr_scheduler_states)

    def save_16bit_model(self, save_dir, save_filename="pytorch_model.bin", exclude_frozen_parameters=False):
        self.engine.save_16bit_model(save_dir, save_filename, exclude_frozen_parameters)
        return True

    # ---------------------------------------------------------------- what zerolab refuses
    @contextmanager
    def no_sync(self):
        assert self.engine.stage < 2, (f"no_sync context manager is incompatible with gradient partitioning "
                                       f"logic of ZeRO stage {self.engine.stage}")   # DeepSpeed's own refusal
        _refuse("engine.no_sync()", "zerolab's engine already skips the gradient reduction between accumulation "
                "boundaries: set gradient_accumulation_steps in the config")
        yield

    def train_batch(self, data_iter=None):
        _refuse("engine.train_batch() without a PipelineModule", "build the model as deepspeed.pipe.PipelineModule "
                "(as DeepSpeed requires), or call engine(x), engine.backward(loss), engine.step() per micro-batch")

    def eval_batch(self, data_iter, *args, **kwargs):
        _refuse("engine.eval_batch() without a PipelineModule", "under torch.no_grad() call engine(x)")

    def __getattr__(self, name):
        for owner in (self.__dict__["engine"], self.__dict__["engine"].module):
            try:
                return getattr(owner, name)
            except AttributeError:
                pass
        raise AttributeError(f"'DeepSpeedEngine' (zerolab) has no attribute {name!r}, nor has the zerolab engine "
                             f"or the model")


def group_lrs(engine) -> list[float]:
    """Each parameter group's learning rate for the next step, as the engine's optimizer will apply it."""
    return getattr(engine.optimizer, "math", engine.optimizer).group_lrs(engine.get_lr())


class DeepSpeedOptimizer:
    """What ``deepspeed.initialize`` returns as ``optimizer``: live ``param_groups`` (lr, betas, ...);
    the update itself is ``engine.step()``, as in DeepSpeed."""

    def __init__(self, engine):
        self.engine = engine

    @property
    def param_groups(self):
        e = self.engine
        hypers, lrs = getattr(e.optimizer, "math", e.optimizer).hypers, group_lrs(e)
        params = [list(e.module.parameters())] if len(hypers) == 1 else [[] for _ in hypers]
        if len(hypers) > 1:
            for p in e.module.parameters():
                k = e.group_of.get(id(p))
                if k is not None:
                    params[k].append(p)
        out = []
        for h, ps, lr in zip(hypers, params, lrs):   # each group's lr for the next step (engine/optim.py)
            group = {k: v for k, v in vars(h).items() if k in ("weight_decay", "betas", "eps", "momentum",
                                                               "dampening", "nesterov")}
            group.update(params=ps, lr=lr)
            out.append(group)
        return out

    @property
    def loss_scale(self):
        return self.engine.loss_scale

    cur_scale = loss_scale

    def zero_grad(self, set_to_none=True):
        """Gradients are zero after every optimizer step (engine.step() clears them): allowed there."""
        if self.engine.micro_steps % self.engine.gas:
            _refuse("optimizer.zero_grad() inside an accumulation window", "engine.step() clears the gradients "
                    "at the accumulation boundary")

    def step(self, closure=None):
        _refuse("optimizer.step()", "call engine.step(): it updates at the accumulation boundary")

    def state_dict(self):
        _refuse("optimizer.state_dict()", "the state is sharded across ranks; use engine.save_checkpoint(dir)")

    def load_state_dict(self, state_dict):
        _refuse("optimizer.load_state_dict()", "use engine.load_checkpoint(dir)")


class DeepSpeedScheduler:
    """What ``deepspeed.initialize`` returns as ``lr_scheduler`` for the config's ``"scheduler"``: the
    engine advances it at each optimizer step (as DeepSpeed's engine does), so scripts only read it."""

    def __init__(self, ds_engine):
        self.ds_engine = ds_engine

    @property
    def last_batch_iteration(self):
        return self.ds_engine.engine.optimizer.step_count - 1

    def get_lr(self):
        return self.ds_engine.get_lr()

    get_last_lr = get_lr

    def state_dict(self):
        return {"last_batch_iteration": self.last_batch_iteration}

    def step(self, last_batch_iteration=None):
        _refuse("lr_scheduler.step()", "the engine advances the schedule at each optimizer step (DeepSpeed's "
                "engine does too, so a script that also calls it would step twice there)")
