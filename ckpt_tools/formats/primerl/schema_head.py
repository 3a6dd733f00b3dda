"""prime-rl HEAD 559b447 (Aug 2026): every key of the trainer config, with its default.

Transcribed from `TrainerConfig` of commit 559b44772e471d1538537b8805cc77f3824a5e64
(packages/prime-rl-configs/src/prime_rl/configs/trainer.py, shared.py, monitors.py; prime-rl-configs
0.4.0). At HEAD every table forbids unknown keys (`prime_pydantic_config.BaseConfig`), the optimizer
and scheduler included. The rl entrypoint dumps the resolved trainer config to
`<run_dir>/configs/trainer.json` (entrypoints/rl.py:77-85), which is this tree under `trainer`.
HEAD's orchestrator, inference and rl configs depend on verifiers and renderers; ckpt-tools reads
their JSON values but knows no schema for them (their keys are not checked).

Facts of this generation the doctor relies on: `dist_timeout_seconds` defaults to 3600
(trainer.py:649); `model.optim_cpu_offload` defaults to true (and then a resume keeps the freshly built
scheduler's lr: trainer/ckpt.py:104-124); the LoRA scale is the trainer's `model.lora.alpha / rank`
(alpha default 32.0, rank 16); resuming is `[trainer.resume] step` (no `ckpt.resume_step`).
"""

from __future__ import annotations

from .schema import FORBID, FREE, OPTIONAL, REQUIRED, SUB, Schema, T, V

__all__ = ["TRAINER_SCHEMA"]

_TRAINER_TABLES = (
    T(
        "",
        FORBID,
        {
            "model": SUB,
            "tokenizer": SUB,
            "data": SUB,
            "loss": SUB,
            "optim": SUB,
            "scheduler": SUB,
            "ckpt": OPTIONAL,
            "resume": OPTIONAL,
            "weight_broadcast": SUB,
            "rollout_transport": SUB,
            "log": SUB,
            "monitors": SUB,
            "output_dir": "outputs",
            "matmul_precision": "high",
            "max_steps": None,
            "enable_router_replay": False,
            "memory_profiler_path": None,
            "gc": SUB,
            "trace_path": None,
            "dist_timeout_seconds": 3600,
            "heartbeat": OPTIONAL,
            "metrics_server": OPTIONAL,
            "enable_token_export": False,
            "env_vars": FREE({}),
        },
    ),
    T(
        "ckpt",
        FORBID,
        {
            "output_dir": None,
            "interval": None,
            "keep_last": None,
            "keep_interval": None,
            "skip_progress": False,
            "skip_scheduler": False,
            "skip_dataloader": False,
            "skip_optimizer": False,
        },
    ),
    T("data", FORBID, {"fake": OPTIONAL}),
    T("data.fake", FORBID, {"batch_size": 2, "generate_samples": False}),
    T("gc", FORBID, {"interval": 50}),
    T("heartbeat", FORBID, {"url": REQUIRED}),
    T(
        "log",
        FORBID,
        {
            "level": "info",
            "vf_level": "info",
            "json_logging": False,
            "log_data": False,
            "interval": 10.0,
            "ranks_filter": [0],
        },
    ),
    V(
        "loss",
        FORBID,
        default="default",
        variants={
            "default": {
                "type": "default",
                "dppo_mask_low": 0.2,
                "dppo_mask_high": 0.2,
                "adv_tau": 1.0,
                "kl_tau": 0.001,
            },
            "ipo": {"type": "ipo", "ipo_threshold": 0.1, "adv_tau": 1.0, "kl_tau": 0.001},
            "custom": {"type": "custom", "import_path": REQUIRED, "kwargs": {}},
        },
    ),
    T("metrics_server", FORBID, {"port": 8000, "host": "0.0.0.0"}),
    T(
        "model",
        FORBID,
        {
            "name": "Qwen/Qwen3-0.6B",
            "trust_remote_code": False,
            "vlm": OPTIONAL,
            "conversion_dir": None,
            "seq_len": 2048,
            "attn": "auto",
            "compile": SUB,
            "ac": SUB,
            "ac_offloading": SUB,
            "fsdp_cpu_offload": False,
            "optim_cpu_offload": True,
            "full_offload": OPTIONAL,
            "reshard_after_forward": True,
            "dp_replicate": 1,
            "ep": "auto",
            "ep_comm_backend": "torch",
            "deepep_num_sms": 20,
            "deepep_token_chunk_size": None,
            "cp": 1,
            "cp_style": "ring",
            "impl": "auto",
            "optimization_dtype": "float32",
            "reduce_dtype": "float32",
            "moe_router_dtype": "float32",
            "moe_use_grouped_mm": True,
            "moe_fused_kernel": False,
            "quantization": OPTIONAL,
            "index_cache": OPTIONAL,
            "freeze_moe_router": False,
            "lora": OPTIONAL,
            "debug": SUB,
            "fused_lm_head_token_chunk_size": 8192,
        },
    ),
    T("model.ac", FORBID, {"mode": "full", "freq": 1, "targets": ["norm"]}),
    T("model.ac_offloading", FORBID, {"pin_memory": True, "max_inflight_activations": 5}),
    T("model.compile", FORBID, {"fullgraph": False}),
    T("model.debug", FORBID, {"num_layers": None, "random_init": False, "force_balanced_routing": False}),
    T("model.full_offload", FORBID, {"cpu_optimizer_backend": "native", "numa_bind": True}),
    T("model.index_cache", FORBID, {"topk_freq": 1, "topk_pattern": None}),
    T(
        "model.lora",
        FORBID,
        {
            "rank": 16,
            "alpha": 32.0,
            "dropout": 0.0,
            "target_modules": [
                "q_proj",
                "k_proj",
                "v_proj",
                "o_proj",
                "gate_proj",
                "up_proj",
                "down_proj",
                "experts",
                "fc1_latent_proj",
                "fc2_latent_proj",
            ],
            "modules_to_save": [],
        },
    ),
    V(
        "model.quantization",
        FORBID,
        default=None,
        variants={
            "fp8": {
                "type": "fp8",
                "enable_grouped_gemm": True,
                "ignore_patterns": [
                    "lm_head",
                    "router",
                    "mlp\\.gate\\.",
                    "shared_expert_gate",
                    "eh_proj",
                    "weights_proj",
                    "in_proj_a",
                    "in_proj_b",
                ],
            },
            "mxfp8": {
                "type": "mxfp8",
                "recipe": "mxfp8_rceil",
                "enable_grouped_gemm": True,
                "enable_a2a": True,
                "ignore_patterns": [
                    "lm_head",
                    "router",
                    "mlp\\.gate\\.",
                    "shared_expert_gate",
                    "eh_proj",
                    "weights_proj",
                    "in_proj_a",
                    "in_proj_b",
                ],
            },
        },
    ),
    T(
        "model.vlm",
        FORBID,
        {"vision_encoder_attr": REQUIRED, "language_model_attr": REQUIRED, "freeze_vision_encoder": True},
    ),
    T("monitors", FORBID, {"wandb": OPTIONAL, "file": SUB}),
    T("monitors.file", FORBID, {"path": "metrics.jsonl"}),
    T(
        "monitors.wandb",
        FORBID,
        {"project": "prime-rl", "entity": None, "name": None, "group": None, "tags": None, "offline": False},
    ),
    V(
        "optim",
        FORBID,
        default="adamw",
        variants={
            "sgd": {
                "lr": 1e-06,
                "weight_decay": 0.01,
                "max_norm": 1.0,
                "type": "sgd",
                "nesterov": True,
                "momentum": 0.9,
            },
            "adamw": {
                "lr": 1e-06,
                "weight_decay": 0.01,
                "max_norm": 1.0,
                "type": "adamw",
                "betas1": 0.9,
                "betas2": 0.999,
            },
            "muon": {
                "lr": 1e-06,
                "weight_decay": 0.01,
                "max_norm": 1.0,
                "type": "muon",
                "mu": 0.95,
                "betas1": 0.9,
                "betas2": 0.95,
            },
            "sign_sgd": {"lr": 1e-06, "weight_decay": 0.01, "max_norm": 1.0, "type": "sign_sgd"},
        },
    ),
    T("resume", FORBID, {"step": None, "dir": None}),
    V(
        "rollout_transport",
        FORBID,
        default="zmq",
        variants={
            "filesystem": {"type": "filesystem"},
            "zmq": {"type": "zmq", "host": "localhost", "port": 5555, "hwm": 10},
        },
    ),
    V(
        "scheduler",
        FORBID,
        default="constant",
        variants={
            "constant": {"type": "constant"},
            "linear": {"type": "linear", "warmup_steps": 10, "decay_steps": 10, "min_lr": 0.0},
            "cosine": {"type": "cosine", "warmup_steps": 10, "min_lr": 0.0},
        },
    ),
    T("tokenizer", FORBID, {"name": None, "trust_remote_code": None, "chat_template": None}),
    V(
        "weight_broadcast",
        FORBID,
        default="filesystem",
        variants={
            "filesystem": {"type": "filesystem"},
            "nccl": {
                "host": "localhost",
                "port": 29501,
                "timeout": 1200,
                "inference_world_size": 1,
                "type": "nccl",
                "quantize_in_weight_transfer": False,
            },
            "nixl": {
                "host": "localhost",
                "port": 8001,
                "timeout": 1200,
                "inference_world_size": 1,
                "type": "nixl",
                "session_id": "default",
            },
        },
    ),
)

TRAINER_SCHEMA = Schema.of(
    "head",
    "559b44772e471d1538537b8805cc77f3824a5e64",
    "prime-rl 559b447 TrainerConfig (packages/prime-rl-configs/.../configs/trainer.py)",
    _TRAINER_TABLES,
    prefix="trainer",
)
