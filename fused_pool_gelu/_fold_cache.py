"""ModelNew's fold cache, and the op that reads it in traced graphs (cached_model_forward).

``fold(weight, bias, k)`` (and, on CUDA in float32, its prepared copy) is made once per parameter
update and kept in one process-wide cache. Eager ModelNew reads it directly: inference calls run
``forward`` on it, gradient-taking ones hand it to ``model_forward``, whose backward still sends the
gradients to weight and bias. torch.compile, torch.export and torch.jit.trace turn ModelNew into
graphs that take the parameters as inputs and cannot read their version counters, where a fold
would run at every call (twice the forward's time at the default shape): ModelNew's traced forward
calls the op ``fused_pool_gelu::cached_model_forward`` instead wherever the trace needs no gradient
of the parameters, and in every exported graph; the op reads the cache at run time.

An entry is keyed by the parameters' storages and pool_kernel_size, and serves while the
parameters keep their stamp (stamp() below) and no torch.optim optimizer has stepped since it was
made (fused optimizers write without bumping version counters): load_state_dict, ``.to()``, any
in-place change or optimizer step replaces it. It holds weak references to the storages only, so it never keeps a
freed model's memory past the next miss. Not cached, folded at every call: FSDP2's unsharded
parameters (written in place with their version counter kept), tensor subclasses (fake and
functional tensors while tracing, DTensors), and calls under CUDA-graph capture, whose replays must
follow later parameter updates; parameters that carry a forward-mode AD tangent go to the fold op,
which refuses them (a dual tensor has its primal's stamp). Writes that bypass the version counter
outside an optimizer step (through ``.data`` or ``.detach()``, in-place collectives such as
``dist.broadcast(p.detach())``, NumPy or DLPack views) are not seen: ``ModelNew.invalidate_fold()``
drops the parameters' entries.

The op is tagged cudagraph_unsafe: inductor's CUDA graphs (mode="reduce-overhead", and
"max-autotune") would replay its kernels on the fold cached when they were recorded; inductor runs
the op outside its graphs instead.
"""

from __future__ import annotations

import sys
import weakref
from typing import NamedTuple, Optional, Tuple

import torch
from torch import Tensor, nn
from torch.autograd import forward_ad
from torch.multiprocessing.reductions import StorageWeakRef
from torch.optim.optimizer import register_optimizer_step_post_hook

from . import _func, ops

_PLAIN_TENSOR_TYPES = (Tensor, nn.Parameter)
_FOLD = torch.ops.fused_pool_gelu.fold.default

# (weight storage, bias storage or None, pool_kernel_size) -> (stamp, storage refs, folded,
# versions of the folded tensors and the optimizer steps counted when it was made).
_ENTRIES: dict = {}

# Steps of every torch.optim optimizer so far. Fused optimizers (fused=True) write the parameters
# without bumping their version counters: an entry made before any optimizer step is not served
# after it.
_optimizer_steps = 0


def _count_optimizer_step(optimizer, args, kwargs):
    global _optimizer_steps
    _optimizer_steps += 1


register_optimizer_step_post_hook(_count_optimizer_step)


def stamp(weight: Tensor, bias: Optional[Tensor]) -> tuple:
    """What identifies the values of weight and bias without reading them: a parameter is
    unchanged while it views the same storage at the same address with the same shape and
    strides, with the same version counter (every in-place op, optimizer steps and
    load_state_dict included, bumps it; `.data = ...` does not). The storage is its
    StorageImpl's address, which the cache entry pins with a weak reference (storage_refs): a
    storage assigned through `.data` after the cached one was freed cannot take that address,
    while its data may well reuse the freed data's. One flat tuple, the storages first: this runs
    at every inference call, and host time counts at small batch. Raises RuntimeError for tensors
    without a storage (functorch's wrappers)."""
    if bias is None:
        return (weight.untyped_storage()._cdata, weight.data_ptr(), weight.shape,
                weight.stride(), weight._version, weight.dtype, weight.device)
    return (weight.untyped_storage()._cdata, bias.untyped_storage()._cdata, weight.data_ptr(),
            weight.shape, weight.stride(), weight._version, weight.dtype, weight.device,
            bias.data_ptr(), bias.shape, bias.stride(), bias._version, bias.dtype, bias.device)


def storage_refs(weight: Tensor, bias: Optional[Tensor], stamped: tuple) -> Optional[tuple]:
    """Weak references to the storages, held by a cache entry: while they live, no other storage
    can have the stamped StorageImpl addresses. None where a storage is no longer the stamped one
    (another thread assigned `.data` since the stamp): then nothing is cached."""
    refs = (StorageWeakRef(weight.untyped_storage()),)
    if bias is not None:
        refs += (StorageWeakRef(bias.untyped_storage()),)
    return refs if tuple(ref.cdata for ref in refs) == stamped[:len(refs)] else None


def fold_once(weight: Tensor, bias: Optional[Tensor], pool_kernel_size: int,
              prepare: bool) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
    """fold(weight, bias, k) and, with prepare on CUDA float32, its prepared copy, as plain
    tensors without autograd history (also under inference_mode: a model cached there must still
    serve later calls whose input requires grad)."""
    # After inference_mode(False), with no autograd history (a graph node would hold the
    # parameters alive): the op itself below autograd, skipping the public wrapper's checks and
    # routing (ModelNew checked its arguments), host time at every parameter update; the public
    # op where forward-mode AD or a torch.func transform is active (its tangent check, its
    # transform path).
    if forward_ad._current_level >= 0 or torch._C._are_functorch_transforms_active():
        with torch.inference_mode(False), torch.no_grad():
            pooled_weight, pooled_bias = ops.fold(weight, bias, pool_kernel_size)
    else:
        with torch.inference_mode(False), torch._C._AutoDispatchBelowADInplaceOrView():
            pooled_weight, pooled_bias = _FOLD(weight, bias, pool_kernel_size)
    prepared_weight = (prepared_copy(pooled_weight)
                       if prepare and reads_prepared(weight) else None)
    return pooled_weight, pooled_bias, prepared_weight


def prepared_copy(pooled_weight: Tensor) -> Tensor:
    """ops.prepare_weight(pooled_weight), made once where a fold is cached instead of in every
    large-batch call (half the pooled weight's bytes)."""
    with torch.inference_mode(False), torch.no_grad():
        return ops.prepare_weight(pooled_weight)


def reads_prepared(weight: Tensor) -> bool:
    """Whether the forward on this weight's fold reads a prepared copy (ops.prepare_weight): the
    CUDA float32 one does, at large batch."""
    return weight.is_cuda and weight.dtype == torch.float32


# torch's FSDP2 (fully_shard) module that defines FSDPState; loaded only by programs that use it.
FSDP_STATE_MODULE = "torch.distributed.fsdp._fully_shard._fsdp_state"

# id of each unsharded parameter written_in_place_by_fsdp found -> a weak reference to the
# FSDPParam that owns it (not to the tensor: torch.utils.swap_tensors refuses tensors with weak
# references, and load_state_dict may swap ModelNew's parameters).
_FSDP_UNSHARDED_PARAMETERS = {}


def written_in_place_by_fsdp(tensor: Tensor) -> bool:
    """Whether ``tensor`` is a parameter that FSDP2 all-gathers into: it rewrites that tensor at
    every unshard with its version counter preserved (on a caching allocator often at the same
    address), so a fold cached on it would go stale. FSDP keeps one unsharded parameter object
    across iterations: found once, it is recognised from then on by its id."""
    fsdp_state = sys.modules.get(FSDP_STATE_MODULE)
    if fsdp_state is None:
        return False
    known = _FSDP_UNSHARDED_PARAMETERS.get(id(tensor))
    if known is not None and getattr(known(), "_unsharded_param", None) is tensor:
        return True
    from torch.distributed._composable_state import _module_state_mapping

    for state_ref in list(_module_state_mapping.values()):
        state = state_ref()
        if not isinstance(state, fsdp_state.FSDPState):
            continue
        try:
            for group in state._fsdp_param_groups:
                for fsdp_param in group.fsdp_params:
                    if getattr(fsdp_param, "_unsharded_param", None) is tensor:
                        _FSDP_UNSHARDED_PARAMETERS[id(tensor)] = weakref.ref(fsdp_param)
                        return True
        except AttributeError:  # FSDP's internals moved: assume it writes, cache nothing
            return True
    return False


def _cacheable(weight: Tensor, bias: Optional[Tensor]) -> bool:
    if type(weight) not in _PLAIN_TENSOR_TYPES or (
            bias is not None and type(bias) not in _PLAIN_TENSOR_TYPES):
        return False
    return not (written_in_place_by_fsdp(weight)
                or (bias is not None and written_in_place_by_fsdp(bias)))


def _carries_tangent(weight: Tensor, bias: Optional[Tensor]) -> bool:
    """Whether weight or bias carries a forward-mode AD tangent at the current dual level."""
    return any(t is not None and forward_ad.unpack_dual(t).tangent is not None
               for t in (weight, bias))


class Miss(NamedTuple):
    """What lookup read before a fold is made, from which store makes the fold's entry: the
    parameters' stamp and the optimizer steps counted then (a step after them makes the entry
    stale)."""

    key: tuple
    stamped: tuple
    optimizer_steps: int


def lookup(weight: Tensor, bias: Optional[Tensor], pool_kernel_size: int
           ) -> Tuple[Optional[Tuple[Tensor, Tensor, Optional[Tensor]]], Optional[Miss]]:
    """(the entry's fold or None, a Miss or None). The fold is served while the parameters are
    unchanged; its prepared copy may be None (folded by a training call). The Miss, given with
    no fold or a fold without its copy, is what store needs to make the entry of a fold made
    after this call; None where nothing may be cached (module docstring): no stamp, CUDA-graph
    capture, or a forward-mode AD tangent on weight or bias (a dual tensor shares its primal's
    storage and stamp: its primal's fold would drop the tangent, the output's silently zero; the
    fold op, which cached_fold calls instead, refuses it naming the argument)."""
    if forward_ad._current_level >= 0 and _carries_tangent(weight, bias):
        return None, None
    try:
        stamped = stamp(weight, bias)
    except RuntimeError:
        # Nothing to stamp: functorch's wrappers (torch.func.vmap over stacked parameters, an
        # ensemble through functional_call: new objects at every call anyway, folded as they
        # are, inside the transforms), and inference tensors (parameters created under
        # inference_mode), which have no version counter to see a change by.
        return None, None
    if weight.is_cuda and torch.cuda.is_current_stream_capturing():
        return None, None
    key = (stamped[0], stamped[1] if bias is not None else None, pool_kernel_size)
    optimizer_steps = _optimizer_steps  # read with the stamp, before any fold
    entry = _ENTRIES.get(key)
    # A hit needs no check of the entry's weak references: they pin the stamped StorageImpl
    # addresses, so a live storage at that address is the stamped one (and only cacheable
    # parameters make entries).
    if entry is not None:
        entry_stamp, _, cached, versions = entry
        if entry_stamp == stamped and versions == (cached[0]._version, cached[1]._version,
                                                   optimizer_steps):
            if cached[2] is not None:
                return cached, None
            return cached, Miss(key, stamped, optimizer_steps)
    return None, Miss(key, stamped, optimizer_steps)


def store(miss: Miss, weight: Tensor, bias: Optional[Tensor],
          folded: Tuple[Tensor, Tensor, Optional[Tensor]]) -> None:
    """Makes the entry of `folded`, the fold of weight and bias made since lookup gave `miss`,
    where the parameters can be cached."""
    if not _cacheable(weight, bias):
        return
    previous = _ENTRIES.get(miss.key)
    if previous is not None:
        # The same storages (the key holds their StorageImpl addresses, which the entry's weak
        # references pin): a parameter update, every training step. Their references are kept,
        # where new ones would cost host time per step; the storages must still be the stamped
        # ones, as storage_refs checks.
        refs = previous[1]
        if weight.untyped_storage()._cdata != miss.stamped[0] or (
                bias is not None and bias.untyped_storage()._cdata != miss.stamped[1]):
            return
    else:
        refs = storage_refs(weight, bias, miss.stamped)
        if refs is None:
            return
    if previous is None or len(_ENTRIES) > 1:
        # Other parameters' entries: drop those whose storages died. A snapshot (one C-level
        # copy): other threads may add entries meanwhile.
        for stale_key in [k for k, (_, r, _, _) in list(_ENTRIES.items())
                          if any(ref.expired() for ref in r)]:
            _ENTRIES.pop(stale_key, None)
    _ENTRIES[miss.key] = (miss.stamped, refs, folded,
                          (folded[0]._version, folded[1]._version, miss.optimizer_steps))


def cached_fold(weight: Tensor, bias: Optional[Tensor], pool_kernel_size: int,
                prepare: bool = True) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
    """(pooled_weight, pooled_bias, prepared_weight or None) from the process-wide cache, made
    and cached on a miss where the parameters can be (module docstring)."""
    cached, miss = lookup(weight, bias, pool_kernel_size)
    if cached is not None:
        if cached[2] is not None or not (prepare and reads_prepared(weight)):
            return cached
        folded = (*cached[:2], prepared_copy(cached[0]))
    elif miss is not None:
        folded = fold_once(weight, bias, pool_kernel_size, prepare)
    elif weight.is_cuda and torch.cuda.is_current_stream_capturing():
        return fold_once(weight, bias, pool_kernel_size, prepare)
    else:  # no stamp (lookup): functorch's wrappers take the public op's transform path
        return (*ops.fold(weight, bias, pool_kernel_size), None)
    store(miss, weight, bias, folded)
    return folded


def forget(weight: Tensor, bias: Optional[Tensor]) -> None:
    """Drops the entries of these parameters (ModelNew.invalidate_fold)."""
    try:
        storages = {weight.untyped_storage()._cdata}
        if bias is not None:
            storages.add(bias.untyped_storage()._cdata)
    except RuntimeError:
        return
    for key in [k for k in list(_ENTRIES) if k[0] in storages or k[1] in storages]:
        _ENTRIES.pop(key, None)


def needs_recorded_fold(weight: Tensor) -> bool:
    """Whether a gradient-taking call must fold in its own graph rather than take a cached fold:
    under autocast (whose model_forward kernel runs above autograd, so autograd reaches weight
    and bias only through a fold it records) and inside torch.func transforms (whose wrappers
    carry the gradient)."""
    device_type = weight.device.type  # the op has autocast kernels for these two only
    return ((device_type in ("cpu", "cuda") and torch.is_autocast_enabled(device_type))
            or _func.transforms_active())


def _cached_model_forward_autograd(x, weight, bias, pool_kernel_size, scale):
    plain = (type(x) in _PLAIN_TENSOR_TYPES and type(weight) in _PLAIN_TENSOR_TYPES
             and (bias is None or type(bias) in _PLAIN_TENSOR_TYPES)
             and torch._C._get_tracing_state() is None)
    needs_grad = torch.is_grad_enabled() and (
        x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad))
    if not needs_grad:
        if plain:  # a call at run time: straight to the kernel below
            return _cached_model_forward_kernel(x, weight, bias, pool_kernel_size, scale)
        # Traced (fake or functional tensors, jit.trace): below autograd as one op, so that the
        # tracer records this node, not the cached fold inside it.
        with torch._C._AutoDispatchBelowAutograd():
            return _CACHED_MODEL_FORWARD(x, weight, bias, pool_kernel_size, scale)
    if not plain or needs_recorded_fold(weight):
        # Traced for a gradient (a joint graph of AOTAutograd), autocast, torch.func: the fold
        # recorded with the forward.
        return ops.forward(x, *ops.fold(weight, bias, pool_kernel_size), scale)
    return ops.model_forward(x, weight, bias, pool_kernel_size, scale,
                             *cached_fold(weight, bias, pool_kernel_size, prepare=False))


def _cached_model_forward_kernel(x, weight, bias, pool_kernel_size, scale):
    pooled_weight, pooled_bias, prepared_weight = cached_fold(weight, bias, pool_kernel_size)
    return _FORWARD(x, pooled_weight, pooled_bias, scale, prepared_weight)


def _cached_model_forward_fake(x, weight, bias, pool_kernel_size, scale):
    return torch.ops.fused_pool_gelu.model_forward(x, weight, bias, pool_kernel_size, scale)


_lib = torch.library.Library("fused_pool_gelu", "FRAGMENT")
# Defined here, not with the other schemas in csrc/registration.cpp: its kernels are these Python
# functions, and its tag is newer than some torch versions the package supports.
_lib.define(
    "cached_model_forward(Tensor x, Tensor weight, Tensor? bias, int pool_kernel_size, "
    "float scale) -> Tensor",
    tags=(torch.Tag.cudagraph_unsafe,) if hasattr(torch.Tag, "cudagraph_unsafe") else (),
)
# Autograd: model_forward on the cached fold when a gradient is needed, else below autograd.
# CompositeExplicitAutograd: forward on the cached fold. Fake: model_forward's checks and output.
_lib.impl("cached_model_forward", _cached_model_forward_autograd, "Autograd")
_lib.impl("cached_model_forward", _cached_model_forward_kernel, "CompositeExplicitAutograd")
torch.library.register_fake("fused_pool_gelu::cached_model_forward", _cached_model_forward_fake,
                            lib=_lib)


_CACHED_MODEL_FORWARD = torch.ops.fused_pool_gelu.cached_model_forward.default
# The C++ op (its kernels check the inputs): the public wrapper's checks are for Python callers.
_FORWARD = torch.ops.fused_pool_gelu.forward.default


def cached_model_forward(x: Tensor, weight: Tensor, bias: Optional[Tensor],
                         pool_kernel_size: int, scale: float) -> Tensor:
    """``model_forward(x, weight, bias, k, scale)`` on a fold cached across calls (module
    docstring): what ModelNew's traced graphs call."""
    return _CACHED_MODEL_FORWARD(x, weight, bias, pool_kernel_size, scale)
