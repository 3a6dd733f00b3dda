"""Run inside a CPU vLLM venv (not ours: vLLM pins its own transformers): load a LoRA adapter through vLLM's
own LoRA loader into an engine on MODEL, and save the delta every LoRA layer would apply, as vLLM holds it
(its stacked per-slot buffers, scaling folded into B), so the caller compares it with the truth.

    python tests/vllm_probe.py MODEL ADAPTER OUT.pt [--mixed]

`--mixed`: start the engine with enable_mixed_moe_lora_format=True and send the LoRARequest with
is_3d_lora_weight=True (what vLLM asks for a fused 3-D MoE adapter on a 2-D MoE model). Writes OUT.pt:
{"deltas": {hf weight name: [out, in] fp32 (experts: per expert)}, "generate": "ok" | the error text}.
"""
import os
import sys
import traceback

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")   # the engine in this process: apply_model sees it


def _shapes(model):
    lm = model.lora_manager
    return {n: (type(m).__name__, [tuple(t.shape) for t in getattr(m, "lora_a_stacked", ())],
                [tuple(t.shape) for t in getattr(m, "lora_b_stacked", ())]) for n, m in lm.modules.items()}


def _grab(model):
    lm = model.lora_manager
    lm.activate_adapter(1)
    idx = lm.lora_index_to_id.index(1)
    out = {}
    for name, mod in lm.modules.items():
        if hasattr(mod, "w13_lora_a_stacked"):         # FusedMoEWithLoRA: per expert, slots [E, r, in] / [E, out, r]
            a13, b13 = mod.w13_lora_a_stacked, mod.w13_lora_b_stacked
            a2, b2 = mod.w2_lora_a_stacked[0][idx], mod.w2_lora_b_stacked[0][idx]
            for e in range(a2.shape[0]):
                for proj, a, b in (("gate_proj", a13[0][idx][e], b13[0][idx][e]),
                                   ("up_proj", a13[-1][idx][e], b13[-1][idx][e]),
                                   ("down_proj", a2[e], b2[e])):
                    out[f"{name}.{e}.{proj}.weight"] = (b.float() @ a.float()).cpu()
            continue
        if not isinstance(mod.lora_a_stacked, (list, tuple)) or mod.lora_a_stacked[0].ndim != 4:   # embedding, logits
            continue
        parts = {"qkv_proj": ("q_proj", "k_proj", "v_proj")}.get(name.rsplit(".", 1)[-1])
        for i in range(len(mod.lora_a_stacked)):
            a, b = mod.lora_a_stacked[i][idx, 0], mod.lora_b_stacked[i][idx, 0]
            target = name.rsplit(".", 1)[0] + "." + parts[i] if parts else name
            out[f"{target}.weight"] = (b.float() @ a.float()).cpu()
    return out


def main() -> None:
    import torch
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest
    model, adapter, out = sys.argv[1:4]
    mixed = "--mixed" in sys.argv[4:]
    engine = {"enable_mixed_moe_lora_format": True} if mixed else {}
    llm = LLM(model=model, dtype="float32", enforce_eager=True, max_model_len=64, max_num_seqs=2,
              enable_lora=True, max_lora_rank=16, max_loras=1, **engine)
    req = LoRARequest("adapter", 1, adapter, **({"is_3d_lora_weight": True} if mixed else {}))
    result = {"deltas": None, "generate": None, "load": "ok"}
    try:
        llm.llm_engine.add_lora(req)                    # vLLM's loader: from_local_checkpoint, packing, validation
        (result["deltas"],) = llm.apply_model(_grab)
    except Exception as exc:                            # the refusal is the result
        result["load"] = f"{type(exc).__name__}: {exc}"
        traceback.print_exc()
        if os.environ.get("PROBE_DEBUG"):
            print(llm.apply_model(_shapes))
    if result["deltas"] is not None:
        try:
            llm.generate([{"prompt_token_ids": list(range(3, 15))}], SamplingParams(max_tokens=1), lora_request=req)
            result["generate"] = "ok"
        except Exception as exc:
            result["generate"] = f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
    torch.save(result, out)
    print("probe:", result["load"], "| generate:", result["generate"])


if __name__ == "__main__":
    main()
