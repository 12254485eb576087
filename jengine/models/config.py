"""`ModelConfig`: the runtime's view of a Hugging Face `config.json`.

`ModelConfig.from_hf_dict` reads the checkpoint's `config.json` (as written by transformers 4.x or
5.x) and normalises the few places where the families and the transformers versions disagree.
The fields every family shares are read here; what is particular to a family (Qwen2's always-on
qkv bias, Qwen3's q/k norm, the o_proj bias rule, refused options) is the family's
`parse_config` (jengine/models/{llama,qwen2,qwen3}.py), found through jengine/models/registry.py:

- architecture: the first registered name in `architectures`, or the family of `model_type` when
  `architectures` is null (what `PretrainedConfig.to_dict()` gives for a config built in code);
- head_dim: the config's `head_dim`, else hidden_size // num_attention_heads;
- rope: transformers 5 moved `rope_theta` and `rope_scaling` into `rope_parameters`; both layouts
  become `rope_theta` plus `rope_scaling` = None (plain RoPE) or {"rope_type": ..., params};
- vocabularies: the spec's "Input and output vocabularies" section. The checkpoint's `vocab_size`
  is the embedding size (runtime `input_vocab_size`); its optional `output_vocab_size` is the head
  size (runtime `vocab_size`); missing or null means equal.

The MoE and MLA fields are declared with their dense defaults (0: no experts, no latent
attention) so that checks read fields, not probes; Qwen3-MoE sets the MoE ones, DeepSeek-V3
(jengine/models/deepseek_v3.py) the MLA ones, its `head_dim` (the rotary width) and, when it has
MoE layers, the MoE and correction-bias router ones.

The Hugging Face dict itself is never rewritten.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, Mapping

from jengine.models import registry

_DEFAULT_ROPE_THETA = 10000.0


def check_vocab_sizes(input_vocab_size: Any, vocab_size: Any) -> None:
    """The spec's rule: both positive integers, output vocabulary within the input vocabulary."""
    def is_positive_int(value: Any) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value > 0

    prefix = (f"invalid vocabulary sizes: input_vocab_size={input_vocab_size!r}, "
              f"vocab_size={vocab_size!r}")
    # The checkpoint spells these differently; say so, since that is where a user will look.
    hint = ("(from config.json: vocab_size -> input_vocab_size, "
            "output_vocab_size -> vocab_size; a missing or null output_vocab_size means equal)")
    if not (is_positive_int(input_vocab_size) and is_positive_int(vocab_size)):
        raise ValueError(f"{prefix}: both must be positive integers {hint}")
    if vocab_size > input_vocab_size:
        raise ValueError(f"{prefix}: the output vocabulary (vocab_size) must fit within the input "
                         f"vocabulary (input_vocab_size) {hint}")


@dataclass(frozen=True)
class ModelConfig:
    architecture: str               # HF class name, a registered family (jengine.models.registry)
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None       # None = plain RoPE; else {"rope_type": ..., params}, no rope_theta
    max_position_embeddings: int
    vocab_size: int                 # OUTPUT vocabulary: LM head rows, sampling, logprob targets
    input_vocab_size: int           # embedding rows, input token bounds
    tie_word_embeddings: bool
    attention_bias: bool            # q/k/v projection biases
    qk_norm: bool                   # per-head RMSNorm on q and k (Qwen3)
    torch_dtype: str                # "bfloat16", "float16", "float32" (no "torch." prefix)
    quantization_config: dict | None  # present = quantized checkpoint
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    attention_output_bias: bool = False  # o_proj bias (the family's rule from attention_bias)
    # MoE (0 = dense): routed experts, experts per token, each expert's MLP width.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False    # routing weights divided by their sum
    decoder_sparse_step: int = 1    # every n-th layer is sparse ...
    mlp_only_layers: tuple[int, ...] = ()  # ... except these, which keep a dense MLP
    # LongCat-Flash's MLA: the q and latent LoRA norm scales sqrt(hidden / rank) exist (where they
    # are applied is --mla-lora-scale: jengine/models/layers/mla.py).
    mla_lora_scale: bool = False
    # MLA (0 = plain GQA): latent KV width, query low-rank width, rotary / non-rotary q-k head
    # widths, value head width.
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False   # rotary dims in interleaved pairs (DeepSeek's rope_interleave)
    first_k_dense_replace: int = 0  # DeepSeek-V3: the first k layers keep a dense MLP
    # The correction-bias router (DeepSeek-V3's noaux_tc, jengine/models/layers/deepseek_moe.py):
    # expert groups and how many are kept, the weights' scale, shared experts (each of width
    # moe_intermediate_size), LongCat-Flash's zero experts, the score function.
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    n_shared_experts: int = 0
    zero_expert_num: int = 0
    router_score: str = "softmax"   # "sigmoid" (DeepSeek-V3) or "softmax"
    # Whether HF keeps the router's weight and correction bias in f32 when the model loads in bf16:
    # DeepSeek-V3 does (_keep_in_fp32_modules_strict); LongCat-Flash's list is the non-strict one,
    # which bf16 loads ignore, so its router is rounded to the model dtype like every weight.
    router_in_fp32: bool = True

    def __post_init__(self) -> None:
        check_vocab_sizes(self.input_vocab_size, self.vocab_size)
        for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "max_position_embeddings"):
            _require_positive_int(name, getattr(self, name))
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                             f"num_key_value_heads={self.num_key_value_heads}")
        for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "kv_lora_rank",
                     "q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim",
                     "n_shared_experts", "zero_expert_num"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
        registry.get_family(self.architecture)  # raises listing the registered architectures

    # Frozen dataclasses hash their fields; two are dicts, so hash their canonical JSON instead.
    # (Lets a ModelConfig be a static argument or a cache key.)
    def __hash__(self) -> int:
        values = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            values.append(json.dumps(value, sort_keys=True) if isinstance(value, dict) else value)
        return hash(tuple(values))

    @property
    def is_quantized(self) -> bool:
        return self.quantization_config is not None

    @property
    def split_vocab(self) -> bool:
        """True when the LM head is smaller than the embedding (spec: reduced head)."""
        return self.vocab_size != self.input_vocab_size

    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any]) -> "ModelConfig":
        """Build from a parsed HF `config.json` (or `PretrainedConfig.to_dict()`)."""
        architecture = registry.architecture_of(d)
        family_fields = registry.get_family(architecture).parse_config(d)

        hidden_size = _required(d, "hidden_size")
        num_attention_heads = _required(d, "num_attention_heads")
        # A family may define head_dim itself (MLA: the rotary width, which config.json may omit).
        head_dim = family_fields.pop("head_dim", None) or d.get("head_dim")
        if head_dim is None:
            _require_positive_int("hidden_size", hidden_size)
            _require_positive_int("num_attention_heads", num_attention_heads)
            if hidden_size % num_attention_heads:
                raise ValueError(f"config.json has no head_dim and hidden_size={hidden_size} is not "
                                 f"a multiple of num_attention_heads={num_attention_heads}")
            head_dim = hidden_size // num_attention_heads

        input_vocab_size = _required(d, "vocab_size")
        output_vocab_size = d.get("output_vocab_size")
        vocab_size = input_vocab_size if output_vocab_size is None else output_vocab_size

        rope_theta, rope_scaling = _rope(d)
        quantization_config = d.get("quantization_config")
        if quantization_config is not None and not isinstance(quantization_config, dict):
            raise ValueError(f"quantization_config must be an object, got {quantization_config!r}")

        def shared(name):
            # A family may spell a shared field its own way (LongCat-Flash: num_layers,
            # ffn_hidden_size) and give it in its fields; else config.json's own name.
            return family_fields.pop(name) if name in family_fields else _required(d, name)

        num_key_value_heads = d.get("num_key_value_heads")
        if num_key_value_heads is None:  # older Llama configs: plain multi-head attention
            num_key_value_heads = num_attention_heads

        return cls(
            architecture=architecture,
            hidden_size=hidden_size,
            intermediate_size=shared("intermediate_size"),
            num_hidden_layers=shared("num_hidden_layers"),
            num_attention_heads=num_attention_heads,
            num_key_value_heads=num_key_value_heads,
            head_dim=head_dim,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=_required(d, "max_position_embeddings"),
            vocab_size=vocab_size,
            input_vocab_size=input_vocab_size,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            torch_dtype=normalize_dtype_name(d.get("torch_dtype") or d.get("dtype") or "float32"),
            quantization_config=dict(quantization_config) if quantization_config else None,
            bos_token_id=_optional_token_id("bos_token_id", d.get("bos_token_id")),
            eos_token_ids=token_id_tuple("eos_token_id", d.get("eos_token_id")),
            **family_fields,
        )


def normalize_dtype_name(name: Any) -> str:
    """"torch.bfloat16" / "bfloat16" -> "bfloat16"."""
    text = str(name)
    return text[len("torch."):] if text.startswith("torch.") else text


def token_id_tuple(field: str, value: Any) -> tuple[int, ...]:
    """An HF eos_token_id (int, list of ints or null) as a tuple of ints."""
    if value is None:
        return ()
    values = value if isinstance(value, (list, tuple)) else [value]
    for v in values:
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ValueError(f"{field} must be a token id or a list of token ids, got {value!r}")
    return tuple(values)


def _optional_token_id(field: str, value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, list) and len(value) == 1:  # a few configs wrap bos in a list
        value = value[0]
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{field} must be a token id, got {value!r}")
    return value


def _rope(d: Mapping[str, Any]) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) from either the transformers-4 or the transformers-5 layout."""
    params = d.get("rope_parameters")  # transformers >= 5: theta and scaling together
    if params is None:
        params = d.get("rope_scaling")  # transformers 4: scaling only, theta at top level
    if params is None:
        params = {}
    if not isinstance(params, Mapping):
        raise ValueError(f"rope_parameters/rope_scaling must be an object, got {params!r}")
    if params and all(isinstance(v, Mapping) for v in params.values()):
        # transformers 5 writes per-layer-type parameters for models mixing attention kinds.
        raise ValueError(f"per-layer-type rope parameters are not supported: {dict(params)!r}")

    theta = params.get("rope_theta", d.get("rope_theta", _DEFAULT_ROPE_THETA))
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0:
        raise ValueError(f"rope_theta must be a positive number, got {theta!r}")

    scaling = {k: v for k, v in params.items() if k not in ("rope_theta", "type", "rope_type")}
    rope_type = params.get("rope_type", params.get("type")) or "default"
    if rope_type == "default" and not scaling:
        return float(theta), None
    return float(theta), {"rope_type": rope_type, **scaling}


def _required(d: Mapping[str, Any], name: str) -> Any:
    if d.get(name) is None:
        raise ValueError(f"config.json is missing the required field {name!r}")
    return d[name]


def _require_positive_int(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
