"""The serving phase of each call of a transformers model, inferred from its inputs.

Installed by ``fp4moe.integrations.hf.convert`` (and ``load_model``): a forward pre-hook
on the model sets ``fp4moe.serving_phase`` for the duration of each forward call (a
forward hook, run even when the forward raises, restores it):

* ``"prefill"`` when the call feeds more than one token a sequence (a prompt, a chunk of a
  prompt, or several tokens after a cache), or one token into an absent or empty cache;
* ``"decode"`` when it feeds one token a sequence into a cache that already holds tokens.

In ``model.generate`` the prompt pass is therefore prefill and every later step decode. A
phase set by the caller (``with fp4moe.serving_phase("decode"): model.generate(...)``) is
never overridden; without the hooks each MoELayer falls back to its policy's
``decode_max_tokens`` threshold on the tokens of the call.

The hooks are plain Python over the call's arguments, so ``torch.compile(model,
fullgraph=True)`` traces them: the phase becomes part of the compiled graph's guards. The
phase is process-wide state (``fp4moe.phases``): two threads calling models at once share
it.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from ..phases import current_phase, set_phase

__all__ = ["infer_phase", "install_phase_hooks", "remove_phase_hooks"]


def infer_phase(
    input_ids: torch.Tensor | None = None,
    inputs_embeds: torch.Tensor | None = None,
    cache: Any = None,
) -> str | None:
    """The serving phase of one model call, from what it is fed.

    Args:
        input_ids: [B, S] token ids, or None.
        inputs_embeds: [B, S, H] embeddings (used when ``input_ids`` is None), or None.
        cache: the KV cache passed to the model (the ``cache`` argument in transformers
            5.24, ``past_key_values`` in earlier releases; the hook reads either): a
            ``Cache`` (``get_seq_length()``), a legacy tuple of (key, value), or None.

    Returns:
        ``"prefill"`` when S > 1, or S == 1 and the cache is absent or empty;
        ``"decode"`` when S == 1 and the cache already holds tokens;
        None when neither ``input_ids`` nor ``inputs_embeds`` is given (nothing to infer).
        Under ``torch.compile`` a cache whose length is a tensor (a static cache) counts
        as holding tokens: a one-token call into it is a decode step.
    """
    if input_ids is not None:
        tokens = input_ids.shape[-1]
    elif inputs_embeds is not None:
        tokens = inputs_embeds.shape[-2]
    else:
        return None
    if tokens != 1:
        return "prefill"
    return "prefill" if _cache_is_empty(cache) else "decode"


def _cache_is_empty(cache: Any) -> bool:
    if cache is None:
        return True
    if hasattr(cache, "get_seq_length"):
        n = cache.get_seq_length()
        if isinstance(n, torch.Tensor):
            if torch.compiler.is_compiling():
                return False  # reading it would be a host sync, a graph break
            n = int(n)
        return n == 0
    if isinstance(cache, (tuple, list)):  # legacy ((k, v), ...) with k [B, heads, S, D]
        return len(cache) == 0 or int(cache[0][0].shape[-2]) == 0
    return False  # a cache object we cannot read: assume it holds the prompt


class _PhaseHooks:
    """Forward pre-hook and hook that set the serving phase for one model call."""

    def __init__(self, module: nn.Module) -> None:
        self._stack: list[bool] = []  # per nested call: did `before` set the phase?
        try:
            params = inspect.signature(module.forward).parameters.values()
            self._names: tuple[str, ...] | None = tuple(
                p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
            )
        except (TypeError, ValueError):
            self._names = None

    # copy.deepcopy and torch.save of a converted model: a fresh, empty stack.
    def __getstate__(self) -> dict[str, Any]:
        return {"_names": self._names}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._names = state["_names"]
        self._stack = []

    def before(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        pushed = False
        if current_phase() is None:  # a phase the caller set is never overridden
            phase = infer_phase(**self._inputs(args, kwargs))
            if phase is not None:
                set_phase(phase)
                pushed = True
        self._stack.append(pushed)

    def after(self, module: nn.Module, args: tuple, output: Any) -> None:
        if self._stack and self._stack.pop():
            set_phase(None)

    def _inputs(self, args: tuple, kwargs: dict) -> dict[str, Any]:
        given = dict(kwargs)
        if self._names is not None:
            for name, value in zip(self._names, args):
                given.setdefault(name, value)
        elif args:
            given.setdefault("input_ids", args[0])
        cache = given.get("cache", given.get("past_key_values"))
        ids, embeds = given.get("input_ids"), given.get("inputs_embeds")
        return {
            "input_ids": ids if isinstance(ids, torch.Tensor) else None,
            "inputs_embeds": embeds if isinstance(embeds, torch.Tensor) else None,
            "cache": cache,
        }


_HOOKS_ATTR = "_fp4moe_phase_hooks"


def install_phase_hooks(model: nn.Module) -> None:
    """Set ``fp4moe.serving_phase`` from the inputs of each call of ``model`` (rule:
    :func:`infer_phase`; a phase set by the caller wins). Installing twice is a no-op."""
    if getattr(model, _HOOKS_ATTR, None) is not None:
        return
    hooks = _PhaseHooks(model)
    handles = (
        model.register_forward_pre_hook(hooks.before, with_kwargs=True),
        model.register_forward_hook(hooks.after, always_call=True),
    )
    object.__setattr__(model, _HOOKS_ATTR, handles)


def remove_phase_hooks(model: nn.Module) -> None:
    """Remove the hooks of :func:`install_phase_hooks` (no-op if none)."""
    handles = getattr(model, _HOOKS_ATTR, None)
    if handles is None:
        return
    for handle in handles:
        handle.remove()
    object.__delattr__(model, _HOOKS_ATTR)
