"""The trainer-side model of a HEAD-style run: prime-rl's parameter names, LoRA wrappers, EP and FSDP2.

``build_model(spec, weights_file, rank)`` returns the FSDP2 model exactly as prime-rl's ``setup_model``
lays it out for DCP (trainer/model.py at 559b447): built on the meta device in fp32; LoRA wrappers whose
``base_layer.`` prefix is stripped from state-dict keys (``<m>.lora_A.0`` [r,in], ``<m>.lora_B.0``
[out,r]; grouped experts ``mlp.experts.w{1,2,3}_lora_{A,B}.0`` [E,r,in] / [E,out,r]); Qwen3-MoE in
prime format (``mlp.experts.w1/w2/w3`` stacked, ``mlp.router.gate.weight``); expert parallelism as
torchtitan's ``ExpertParallel`` does it (every expert tensor ``Shard(0)`` on the ``ep`` mesh); then
``fully_shard`` per unit as ``setup_fsdp`` does (experts on ``dp_shard_mod_ep``, the router its own fp32
unit, each block, embed and [lm_head, norm] unless tied, the root), materialized on CPU with each rank
reading only its own rows of the fp32-upcast bf16 weights.

The attention, norms and embeddings are transformers' Qwen3 / Qwen3-MoE modules, whose names equal
prime-rl's custom implementation's. The MoE forward is a plain token-choice top-k loop (not prime-rl's
all-to-all dispatch): with EP it all-gathers the expert weights and reduce-scatters their gradients, so
the parameters, their sharding and their optimizer state are those of the real run.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from tests.factory.head_spec import EXPERT_PROJ, HeadSpec, keep_trainable

_BASE = "base_layer."


class _LoRAWrapper(nn.Module):
    """prime-rl's ``MultiLoRAModule`` contract: a frozen ``base_layer`` whose prefix vanishes from keys."""

    def __init__(self, base_layer: nn.Module, scale: float):
        super().__init__()
        self.base_layer = base_layer
        self.scale = float(scale)
        self._register_state_dict_hook(_strip_base_layer)
        self.register_load_state_dict_pre_hook(_add_base_layer)

    def __getattr__(self, name: str) -> Any:
        # Attribute lookups fall through to the wrapped module, as in prime-rl (DCP's FQN walk relies on it).
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.base_layer, name)


def _strip_base_layer(module, state_dict, prefix, *args):
    old = prefix + _BASE
    for key in [k for k in state_dict if k.startswith(old)]:
        state_dict[prefix + key[len(old):]] = state_dict.pop(key)
    return state_dict


def _add_base_layer(module, state_dict, prefix, *args):
    for key in [k for k in state_dict if k.startswith(prefix) and "lora_A" not in k and "lora_B" not in k]:
        state_dict[prefix + _BASE + key[len(prefix):]] = state_dict.pop(key)


def _one(shape: tuple[int, ...], like: torch.Tensor) -> nn.ParameterList:
    # n_adapters is always 1 at HEAD, so each ParameterList holds slot "0".
    return nn.ParameterList([nn.Parameter(torch.empty(shape, device=like.device, dtype=like.dtype))])


class LoRALinear(_LoRAWrapper):
    """``MultiLoRALinear`` with one adapter: ``base(x) + s * B(A(x))``."""

    def __init__(self, base_layer: nn.Linear, rank: int, scale: float):
        super().__init__(base_layer, scale)
        w = base_layer.weight
        self.lora_A = _one((rank, base_layer.in_features), w)
        self.lora_B = _one((base_layer.out_features, rank), w)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base_layer(x) + self.scale * F.linear(F.linear(x, self.lora_A[0]), self.lora_B[0])


def _full(t: torch.Tensor) -> torch.Tensor:
    """An expert tensor as a plain full tensor: with EP, all-gather it and reduce-scatter its gradient."""
    if not isinstance(t, DTensor):
        return t
    n = t.device_mesh.ndim
    return t.redistribute(t.device_mesh, [Replicate()] * n).to_local(grad_placements=[Partial()] * n)


def _route(x: torch.Tensor, top_idx: torch.Tensor, top_w: torch.Tensor, num_experts: int, expert_fn) -> torch.Tensor:
    out = torch.zeros_like(x)
    for e in range(num_experts):
        tok, k = torch.where(top_idx == e)
        if tok.numel():
            out.index_add_(0, tok, (expert_fn(e, x[tok]) * top_w[tok, k, None]).to(out.dtype))
    return out


class GroupedExperts(nn.Module):
    """prime-rl's ``GroupedExperts``: ``w1`` [E,inter,hid] (gate), ``w2`` [E,hid,inter] (down), ``w3`` (up)."""

    def __init__(self, num_experts: int, hidden: int, inter: int):
        super().__init__()
        self.num_experts = num_experts
        self.w1 = nn.Parameter(torch.empty(num_experts, inter, hidden))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, inter))
        self.w3 = nn.Parameter(torch.empty(num_experts, inter, hidden))

    def forward(self, x, top_idx, top_w):
        w1, w2, w3 = _full(self.w1), _full(self.w2), _full(self.w3)

        def expert(e, xe):
            return F.linear(F.silu(F.linear(xe, w1[e])) * F.linear(xe, w3[e]), w2[e])

        return _route(x, top_idx, top_w, self.num_experts, expert)


class LoRAGroupedExperts(_LoRAWrapper):
    """``MultiLoRAGroupedExperts`` with one adapter: stacked per-expert LoRA on w1, w2 and w3."""

    def __init__(self, base_layer: GroupedExperts, rank: int, scale: float):
        super().__init__(base_layer, scale)
        e, inter, hid = base_layer.w1.shape
        like = base_layer.w1
        # Registration order is prime-rl's (w1 A, B; w2 A, B; w3 A, B): it fixes the optimizer's param order.
        self.w1_lora_A, self.w1_lora_B = _one((e, rank, hid), like), _one((e, inter, rank), like)
        self.w2_lora_A, self.w2_lora_B = _one((e, rank, inter), like), _one((e, hid, rank), like)
        self.w3_lora_A, self.w3_lora_B = _one((e, rank, hid), like), _one((e, inter, rank), like)

    def forward(self, x, top_idx, top_w):
        b = self.base_layer
        w = {n: _full(getattr(b, n)) for n in ("w1", "w2", "w3")}
        ab = {n: (_full(getattr(self, f"{n}_lora_A")[0]), _full(getattr(self, f"{n}_lora_B")[0])) for n in w}
        s = self.scale

        def proj(n, e, xe):
            a, bb = ab[n]
            return F.linear(xe, w[n][e]) + s * F.linear(F.linear(xe, a[e]), bb[e])

        def expert(e, xe):
            return proj("w2", e, F.silu(proj("w1", e, xe)) * proj("w3", e, xe))

        return _route(x, top_idx, top_w, b.num_experts, expert)


class TopKRouter(nn.Module):
    """Token-choice top-k softmax router; ``gate`` is HF's ``mlp.gate`` (fp32, its own FSDP unit)."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, norm_topk_prob: bool):
        super().__init__()
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob

    def forward(self, x):
        probs = torch.softmax(F.linear(x.float(), self.gate.weight.float()), dim=-1)
        top_w, top_idx = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        return top_idx, top_w


class MoE(nn.Module):
    """prime-rl's ``MoE`` layer: ``experts`` then ``router`` (that order is ``named_parameters`` order)."""

    def __init__(self, spec: HeadSpec):
        super().__init__()
        self.experts = GroupedExperts(spec.num_experts, spec.hidden_size, spec.moe_intermediate_size)
        self.router = TopKRouter(spec.hidden_size, spec.num_experts, spec.num_experts_per_tok, spec.norm_topk_prob)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        shape = hidden.shape
        x = hidden.reshape(-1, shape[-1])
        top_idx, top_w = self.router(x)
        return self.experts(x, top_idx, top_w.to(x.dtype)).reshape(shape)


@dataclass
class Meshes:
    """prime-rl's ParallelDims meshes: ``hsdp`` for every FSDP unit but the experts' (``dp_mod_ep``)."""

    hsdp: DeviceMesh
    ep: DeviceMesh | None
    dp_mod_ep: DeviceMesh | None


def build_meshes(spec: HeadSpec) -> Meshes:
    ep = spec.resolved_ep
    if ep == 1:
        return Meshes(init_device_mesh("cpu", (spec.world_size,), mesh_dim_names=("dp_shard_cp",)), None, None)
    # ParallelDims._build_mesh_with_ep: dp_shard = dp_shard_mod_ep * dp_shard_in_ep; the flattened submeshes
    # "dp_shard_cp" (all ranks) and "ep" share the 2-D root, as FSDP2 needs for the experts' 2-D DTensors.
    world = init_device_mesh("cpu", (spec.dp_shard_mod_ep, ep), mesh_dim_names=("dp_shard_mod_ep", "dp_shard_in_ep"))
    hsdp = world["dp_shard_mod_ep", "dp_shard_in_ep"]._flatten(mesh_dim_name="dp_shard_cp")
    return Meshes(hsdp, world["dp_shard_in_ep"]._flatten(mesh_dim_name="ep"), world["dp_shard_mod_ep"])


def _meta_model(spec: HeadSpec, base_dir: Path) -> nn.Module:
    from transformers import AutoConfig, Qwen3ForCausalLM, Qwen3MoeForCausalLM

    config = AutoConfig.from_pretrained(str(base_dir))
    config.use_cache = False
    config._attn_implementation = "sdpa"
    cls = Qwen3MoeForCausalLM if spec.arch == "moe" else Qwen3ForCausalLM
    with torch.device("meta"):
        model = cls(config)
        if spec.arch == "moe":
            for layer in model.model.layers:
                layer.mlp = MoE(spec)  # same slot in _modules: named_parameters order is kept
    model.to(torch.float32)  # optimization_dtype float32: fp32 masters
    return model


def _apply_lora(model: nn.Module, spec: HeadSpec) -> None:
    for fqn in spec.lora_modules():
        parent_name, child = fqn.rsplit(".", 1)
        parent = model.get_submodule(parent_name)
        base = getattr(parent, child)
        wrapper = LoRAGroupedExperts if isinstance(base, GroupedExperts) else LoRALinear
        setattr(parent, child, wrapper(base, spec.lora_rank, spec.scale))


def _freeze(model: nn.Module, spec: HeadSpec) -> None:
    """prime-rl's ``freeze_all_except_lora_and_specified`` (run before FSDP, on the wrapped names)."""
    for name, p in model.named_parameters():
        if not spec.lora or "lora_A" in name or "lora_B" in name:
            p.requires_grad_(True)
        else:
            p.requires_grad_(keep_trainable(name, spec.modules_to_save))


def _apply_ep(model: nn.Module, ep_mesh: DeviceMesh) -> None:
    # torchtitan's ExpertParallel._partition_fn: every parameter of every submodule of mlp.experts
    # becomes a Shard(0) DTensor on the ep mesh (on the meta device, so no data moves).
    for layer in model.model.layers:
        for mod in layer.mlp.experts.modules():
            for name, p in list(mod.named_parameters(recurse=False)):
                dp = nn.Parameter(distribute_tensor(p.data, ep_mesh, [Shard(0)]), requires_grad=p.requires_grad)
                mod.register_parameter(name, dp)


def _apply_fsdp(model: nn.Module, spec: HeadSpec, meshes: Meshes) -> None:
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    fp32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    for block in model.model.layers:
        if spec.arch == "moe":
            if meshes.dp_mod_ep is not None:
                # prime-rl also sets the experts' gradient divide factor to dp_shard * cp; FSDP2 implements
                # that with ReduceOp.PREMUL_SUM, which gloo lacks, so head_train rescales those grads instead.
                fully_shard(block.mlp.experts, mesh=meshes.dp_mod_ep, mp_policy=mp, reshard_after_forward=True)
            fully_shard(block.mlp.router, mesh=meshes.hsdp, mp_policy=fp32, reshard_after_forward=True)
        fully_shard(block, mesh=meshes.hsdp, mp_policy=mp, reshard_after_forward=True)
    if not spec.tie_word_embeddings:  # prime-rl skips this split for tied embeddings (it breaks the tie)
        fully_shard(model.model.embed_tokens, mesh=meshes.hsdp, mp_policy=mp, reshard_after_forward=True)
        fully_shard([model.lm_head, model.model.norm], mesh=meshes.hsdp, mp_policy=mp, reshard_after_forward=False)
    fully_shard(model, mesh=meshes.hsdp, mp_policy=mp, reshard_after_forward=True)


def prime_name(param_name: str) -> str:
    """A parameter's DCP / prime-format name: the wrapper's ``base_layer.`` is not part of it."""
    return param_name.replace("." + _BASE, ".")


def local_chunk(p: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(global offsets, sizes) of this rank's piece, as DCP itself records it (``__create_chunk_list__``)."""
    if isinstance(p, DTensor):
        (chunk,) = p.__create_chunk_list__()
        return tuple(chunk.offsets), tuple(chunk.sizes)
    return (0,) * p.dim(), tuple(p.shape)


class RowReader:
    """Reads leading-dim row ranges of named tensors from one safetensors file or an HF dir (index or not)."""

    def __init__(self, path: Path):
        path = Path(path)
        index = path / "model.safetensors.index.json"
        if path.is_file():
            self.dir, self.weight_map, self.single = path.parent, None, path.name
        elif index.exists():
            self.dir, self.weight_map, self.single = path, json.loads(index.read_text())["weight_map"], None
        else:
            self.dir, self.weight_map, self.single = path, None, "model.safetensors"
        self._handles: dict[str, Any] = {}

    def rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        fname = self.single or self.weight_map[name]
        if fname not in self._handles:
            self._handles[fname] = safe_open(str(self.dir / fname), "pt")
        return self._handles[fname].get_slice(name)[start:stop]


def lora_init(spec: HeadSpec, module_index: int, param_index: int, shape: tuple[int, ...], is_a: bool) -> torch.Tensor:
    """Full-size deterministic LoRA init, the same on every rank and for every world size.

    A is prime-rl's ``kaiming_uniform_(a=sqrt(5))`` (for stacked [E,r,in] torch's fan-in is r*in), B zeros.
    """
    if not is_a:
        return torch.zeros(shape)
    g = torch.Generator().manual_seed((spec.seed * 1_000_003 + module_index * 101 + param_index) % (2**63))
    return nn.init.kaiming_uniform_(torch.empty(shape), a=math.sqrt(5), generator=g)


def _materialize(model: nn.Module, spec: HeadSpec, weights: Path) -> None:
    model.to_empty(device="cpu")
    rotary = model.model.rotary_emb  # non-persistent inv_freq buffers were never materialized
    model.model.rotary_emb = type(rotary)(config=model.config)
    if spec.tie_word_embeddings and model.lm_head.weight is not model.model.embed_tokens.weight:
        raise RuntimeError("tied embeddings came untied during the meta build")
    reader = RowReader(weights)
    modules = {m: i for i, m in enumerate(spec.lora_modules())}
    with torch.no_grad():
        for name, p in model.named_parameters():
            offsets, sizes = local_chunk(p)
            full_shape = tuple(p.shape)
            if any(offsets[1:]) or tuple(sizes[1:]) != full_shape[1:]:
                raise RuntimeError(f"{name}: expected a dim-0 shard, got offsets {offsets} sizes {sizes}")
            start, stop = offsets[0], offsets[0] + sizes[0]
            local = p.to_local() if isinstance(p, DTensor) else p
            if "lora_A" in name or "lora_B" in name:
                module, pname, _slot = name.rsplit(".", 2)
                full = lora_init(spec, modules[module], _lora_param_index(pname), full_shape, "lora_A" in pname)
                local.copy_(full[start:stop])
            else:
                local.copy_(reader.rows(prime_name(name), start, stop).to(torch.float32))


def _lora_param_index(pname: str) -> int:
    # "lora_A" / "lora_B" for linears; "w1_lora_A" ... "w3_lora_B" for grouped experts.
    order = ["lora_A", "lora_B", "w1_lora_A", "w1_lora_B", "w2_lora_A", "w2_lora_B", "w3_lora_A", "w3_lora_B"]
    return order.index(pname)


def build_model(spec: HeadSpec, base_dir: Path, weights: Path) -> tuple[nn.Module, Meshes]:
    """The FSDP2 (+EP) training model, materialized; run on every rank of an initialized gloo group.

    ``weights`` holds the fp32 masters' source in prime naming: the base dir for dense models, the
    converted ``prime/model.safetensors`` for MoE (what prime-rl's first load writes and reads).
    """
    meshes = build_meshes(spec)
    model = _meta_model(spec, base_dir)
    if spec.lora:
        _apply_lora(model, spec)
    _freeze(model, spec)
    if meshes.ep is not None:
        _apply_ep(model, meshes.ep)
    _apply_fsdp(model, spec, meshes)
    _materialize(model, spec, weights)
    return model, meshes


def lora_modules_of(model: nn.Module) -> list[tuple[str, _LoRAWrapper]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, _LoRAWrapper)]


def adapter_tensors(model: nn.Module, spec: HeadSpec) -> dict[str, torch.Tensor]:
    """prime-rl's ``LoRAState.adapter_state_dict()``, gathered (collective: every rank must call it).

    Linear: ``<m>.lora_A.weight``; grouped experts: ``<m>.<e>.<gate|up|down>_proj.lora_{A,B}.weight``.
    """
    out: dict[str, torch.Tensor] = {}
    for name, mod in lora_modules_of(model):
        if isinstance(mod, LoRAGroupedExperts):
            for w, proj in EXPERT_PROJ.items():
                a = gather(getattr(mod, f"{w}_lora_A")[0])
                b = gather(getattr(mod, f"{w}_lora_B")[0])
                for e in range(spec.num_experts):
                    out[f"{name}.{e}.{proj}.lora_A.weight"] = a[e].clone()
                    out[f"{name}.{e}.{proj}.lora_B.weight"] = b[e].clone()
        else:
            out[f"{name}.lora_A.weight"] = gather(mod.lora_A[0])
            out[f"{name}.lora_B.weight"] = gather(mod.lora_B[0])
    return out


def gather(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The full tensor on every rank (collective for DTensors), detached, on CPU."""
    t = t.detach()
    if dtype is not None:
        t = t.to(dtype)
    return (t.full_tensor() if isinstance(t, DTensor) else t).cpu()


def placements_sample(model: nn.Module, limit_layers: int = 1) -> dict[str, dict[str, Any]]:
    """Mesh and placements of the live DTensors of the first layers (DCP's metadata does not record them)."""
    out = {}
    for name, p in model.named_parameters():
        if isinstance(p, DTensor) and (".layers." not in name or int(name.split(".layers.")[1].split(".")[0]) < limit_layers):
            out[prime_name(name)] = {
                "global": list(p.shape), "local": list(p.to_local().shape),
                "mesh": str(p.device_mesh), "placements": str(tuple(p.placements)),
            }
    return out
