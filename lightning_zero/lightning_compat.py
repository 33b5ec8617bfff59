"""What Lightning features need from ZeroStrategy at setup: refusals made up front, and activation checkpointing.
(Parameter counts and the model summary need nothing: a sharded stage-3 parameter keeps its full shape, see
[Note: a sharded parameter keeps its shape].)

[Note: what is refused under zero3, and why]
Stage 3 keeps parameters empty between uses. Lightning's weight-averaging and pruning callbacks run under it as under
DDP (sharded_callbacks.py, [Note: Lightning's weight callbacks under zero3]), and so does ``torch.compile`` of the
model or of its blocks (param_hooks.py, [Note: zero3 under torch.compile]): none of them is refused any more. What
ZeRO cannot shard at any stage is refused at setup, naming the feature and the alternative, instead of failing deep
inside training (sparse gradients).

Everything else Lightning users do under DDP works the same (see tests/distributed/test_lightning_semantics.py).
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.accelerators import XLAAccelerator
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import nn


#: The hooks made to see a step's gradients (where Lightning's docs read them: between the backward and the step).
GRADIENT_HOOKS = ("on_after_backward", "on_before_optimizer_step", "on_before_zero_grad")


def user_code_sees_gradients(trainer: Any) -> bool:
    """Whether user code runs where a step's gradients are meant to be read: manual optimization, a LightningModule
    hook of ``GRADIENT_HOOKS`` (or its own ``optimizer_step`` or ``configure_gradient_clipping``), or a callback of the
    user's (not Lightning's or ours) with one. Only then are the gradient norms one rank may read kept (see [Note: a
    read that runs on one rank] in sharding/joined_reads.py): a plain step issues no collective for them."""
    module = trainer.lightning_module
    if not module.automatic_optimization:
        return True
    if any(is_overridden(hook, module) for hook in (*GRADIENT_HOOKS, "optimizer_step", "configure_gradient_clipping")):
        return True
    theirs = [c for c in trainer.callbacks if not type(c).__module__.startswith(("lightning.", "lightning_zero."))]
    return any(is_overridden(hook, c, parent=Callback) for c in theirs for hook in GRADIENT_HOOKS)


class ZeroUnsupportedError(ValueError):
    """A Lightning feature cannot work under this ZeRO stage; the message names it and the alternative."""


def refuse_accelerator(accelerator: Any) -> None:
    """Lightning refuses the ``XLAAccelerator`` with any strategy but its XLA ones, after it assigned the strategy
    the XLA precision plugin; ZeroStrategy makes the same check when it gets the accelerator, so that the error names
    the accelerator rather than the ``XLAPrecision`` that follows from it."""
    if isinstance(accelerator, XLAAccelerator):
        raise ValueError(
            "The `XLAAccelerator` can only be used with a `SingleDeviceXLAStrategy` or `XLAStrategy`, found "
            "ZeroStrategy, which runs on 'cpu' and 'cuda' accelerators"
        )


def refuse_unsupported(model: nn.Module) -> None:
    """Raise before anything is sharded if the model uses a feature ZeRO cannot support (see [Note: what is refused
    under zero3, and why])."""
    refuse_sparse_gradients(model)


def refuse_sparse_gradients(model: nn.Module) -> None:
    """``nn.Embedding(sparse=True)`` (and ``EmbeddingBag``) produce sparse gradients, which ZeRO cannot
    reduce-scatter into dense row shards; DDP all-reduces them as they are."""
    sparse = [(name, m) for name, m in model.named_modules()
              if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse]
    if sparse:
        name, module = sparse[0]
        raise ZeroUnsupportedError(
            f"{name!r} is an {type(module).__name__}(sparse=True), whose sparse gradients ZeRO cannot shard: build it "
            "with sparse=False (dense gradients, which every optimizer but SparseAdam takes, with the same results), "
            "or use strategy='ddp'"
        )


def mark_sharded_for_transformers(model: nn.Module) -> None:
    """Under zero3 on several ranks, every rank must run every layer of a forward, also in Hugging Face's
    ``generate()`` when its sequences end at different lengths (``synced_gpus=True``). transformers turns that on by
    itself for a model sharded by DeepSpeed ZeRO-3 or FSDP, which it recognizes by the attribute FSDP2 sets on the
    modules it shards; its modules get it here, so that ``generate()`` needs no argument (RankDivergenceError names
    ``synced_gpus=True`` where it is missed). ``torch.compile`` reads that attribute too, and traces such a module
    only if it also says that its parameters are the module's own (FSDP's ``use_orig_params``, as ours are): see
    [Note: zero3 under torch.compile] in sharding/param_hooks.py."""
    for module in model.modules():
        if type(module).__module__.startswith("transformers."):
            module._is_fsdp_managed_module = True
            module._fsdp_use_orig_params = True


def apply_activation_checkpointing(model: nn.Module, policy: tuple[Any, ...]) -> None:
    """Recompute the forward of every submodule whose class matches ``policy`` in backward (torch's
    ``checkpoint_wrapper``, non-reentrant, as Lightning's FSDP strategies apply it). Applied once per model."""
    if not policy:
        return
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointWrapper,
        apply_activation_checkpointing as apply,
        checkpoint_wrapper,
    )

    if any(isinstance(m, CheckpointWrapper) for m in model.modules()):
        return
    matched = [False] * len(policy)

    def check(module: nn.Module) -> bool:
        hits = [_class_matches(module, entry) for entry in policy]
        for i, hit in enumerate(hits):
            matched[i] |= hit
        return any(hits)

    apply(model, checkpoint_wrapper_fn=checkpoint_wrapper, check_fn=check)
    if not any(matched):
        raise ZeroUnsupportedError(
            f"activation_checkpointing_policy={list(_policy_names(policy))} matches no module of "
            f"{type(model).__name__}: give module classes or their names"
        )


def _class_matches(module: nn.Module, entry: Any) -> bool:
    cls = type(module)
    if isinstance(entry, type):
        return isinstance(module, entry)
    return entry in (cls.__name__, f"{cls.__module__}.{cls.__qualname__}")


def _policy_names(policy: tuple[Any, ...]) -> list[str]:
    return [p.__name__ if isinstance(p, type) else p for p in policy]
