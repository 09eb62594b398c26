"""Architecture adapters: the one place that knows Hugging Face internals.

An adapter exposes a causal LM as the pieces self-speculative decoding needs:
the embedding, per-layer rotary tables, each decoder layer's *attention
sublayer* and *MLP sublayer* as separate residual blocks, and the head (final
norm + LM head).  The HF modules themselves do the maths; nothing is copied
from HF modeling files.

Supported ``config.model_type`` values:

* ``llama``, ``mistral``, ``qwen2``, ``qwen3`` -- pre-norm blocks
  ``h + attn(norm(h))`` and ``h + mlp(norm(h))`` (:class:`LlamaAdapter`);
* ``gemma3_text`` -- sandwich norms around both sublayers, per-layer RoPE
  tables and sliding-window layers (:class:`Gemma3Adapter`).

The adapter computes with *shadow* copies of the decoder layers and the LM
head (:func:`selfspec.core.kernels.shadow`): they share the model's parameters,
but their linear layers use the kernels chosen for this machine and their
attention uses a copy of the config set to SDPA.  The user's model object is
never changed: ``model.generate`` stays stock transformers.  Weights changed
in place through their parameters are seen; writes through ``.data`` bypass
the version counter and need :meth:`LlamaAdapter.refresh_kernels`.
"""

from __future__ import annotations

import copy
import inspect
from typing import Any

import torch
import torch.nn.functional as F

from ..core import fused, kernels
from ..core.quant import QuantLinear
from ..errors import UnsupportedModelError

RotaryTable = tuple[torch.Tensor, torch.Tensor]  # (cos, sin), each [1, T, head_dim]
# Rotary kinds whose angles depend on the position alone (not on the longest position of the call, as "dynamic" and
# "longrope" do): their cos/sin rows are computed once per position and looked up (see LlamaAdapter.rotary).
STATIC_ROPE = ("default", "linear", "llama3", "yarn")
ROTARY_ROWS = 1024  # the looked-up tables grow by this many positions at a time
ROTARY_MAX_ROWS = 16384  # ... up to this many (Gemma 3: 32 MB); later positions run the module per call


class LlamaAdapter:
    """Llama-shaped decoder layers (Llama, SmolLM2, Mistral, Qwen2, Qwen3)."""

    model_types = ("llama", "mistral", "qwen2", "qwen3")

    def __init__(self, model: Any) -> None:
        self.model = model
        self.config = model.config
        self.backbone = model.model
        layers = list(self.backbone.layers[: self.config.num_hidden_layers])
        self.num_layers = len(layers)
        self.windows = self._sliding_windows()
        self.layer_types = self._layer_type_keys()
        self._check_supported(layers[0])
        plan = kernels.TORCH_ONLY  # until the engine's kernel plan is set (set_kernel_plan)
        config = self._sdpa_config()
        self.layers = [kernels.shadow(layer, plan, config=config) for layer in layers]
        self.lm_head = kernels.shadow(model.lm_head, plan)
        self.linears = kernels.kernel_linears(torch.nn.ModuleList([*self.layers, self.lm_head]))
        # transformers renamed the attention's cache argument (past_key_values -> cache) in 5.x
        params = inspect.signature(type(layers[0].self_attn).forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self.lean_attention = all(_lean_ok(layer.self_attn) for layer in self.layers)

    # -- static facts ---------------------------------------------------------
    @property
    def max_context(self) -> int:
        return int(getattr(self.config, "max_position_embeddings", 0) or 1 << 30)

    @property
    def vocab_size(self) -> int:
        head = self.model.get_output_embeddings()
        weight = getattr(head, "weight", None)
        return int(weight.shape[0] if weight is not None else head.out_features)  # quantised heads have no weight

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the hidden states (the embedding's; float32 where the embedding is quantised)."""
        weight = getattr(self.model.get_input_embeddings(), "weight", None)
        return torch.float32 if weight is None else weight.dtype

    @property
    def low_precision_drafts(self) -> bool:
        """Whether draft passes can switch to fp16/bf16 weight copies (not where every linear is quantised)."""
        return bool(self.linears)

    def _sliding_windows(self) -> list[int | None]:
        """Per layer: the sliding attention window W (attend to the last W positions) or None."""
        window = getattr(self.config, "sliding_window", None)
        types = getattr(self.config, "layer_types", None)
        if not window:
            return [None] * self.num_layers
        if types is None:  # Mistral-style: one window for every layer
            return [int(window)] * self.num_layers
        return [int(window) if t == "sliding_attention" else None for t in types[: self.num_layers]]

    def _layer_type_keys(self) -> list[str]:
        """The key under which each layer's rotary table is computed (one table for Llama)."""
        return ["default"] * self.num_layers

    def _check_supported(self, layer) -> None:
        for name in ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm"):
            if not hasattr(layer, name):
                raise UnsupportedModelError(f"{self.config.model_type}: decoder layer has no '{name}'")
        if getattr(self.config, "attn_logit_softcapping", None):
            raise UnsupportedModelError(f"{self.config.model_type}: attention logit soft-capping is not supported")

    def _sdpa_config(self) -> Any:
        """The config our shadow layers see: the model's, with SDPA attention (our masks are boolean
        [1, 1, T, K]; HF's eager attention expects additive float masks).  The model's own config is untouched."""
        if getattr(self.config, "_attn_implementation", "sdpa") == "sdpa":
            return None
        config = copy.copy(self.config)
        config._attn_implementation = "sdpa"
        return config

    # -- kernels ----------------------------------------------------------------------------------
    def set_kernel_plan(self, plan: kernels.KernelPlan, *, release: bool = True) -> None:
        kernels.set_plan(self.linears, plan, release=release)

    def refresh_kernels(self) -> None:
        """Drop every prepared weight copy (after writes the version counter cannot see, e.g. via ``.data``)."""
        for m in self.linears:
            m.release()

    def release_draft_copies(self, keep: torch.dtype | None) -> None:
        """Drop prepared copies in draft dtypes other than ``keep`` (memory: keep only what a method uses)."""
        for m in self.linears:
            m.release(dtypes={m.weight.dtype, keep})

    def kernel_memory(self) -> int:
        """Bytes of prepared weight copies (packed, low precision) beyond the model's own weights."""
        return kernels.prepared_bytes(self.linears)

    # -- the fused native path -----------------------------------------------------------------------------------
    norm_offset = 0.0  # RMSNorm scales by weight + offset (Gemma: 1)

    def _norm_pairs(self, layer) -> tuple:
        """(attention in, attention out, MLP in, MLP out) norm modules; out norms None (pre-norm blocks)."""
        return layer.input_layernorm, None, layer.post_attention_layernorm, None

    def fused_layers(self) -> tuple[list[fused.FusedLayer] | None, str]:
        """The decoder layers described for :class:`selfspec.core.fused.FusedStack`, or None and the reason
        (only models whose every layer linear is kept quantised, on the CPU, with RMS norms)."""
        if self.device.type != "cpu":
            return None, f"device {self.device.type}"
        if getattr(self.config, "partial_rotary_factor", 1.0) not in (None, 1.0):
            return None, "partial rotary embedding"
        act = getattr(self.config, "hidden_activation", None) or getattr(self.config, "hidden_act", None)
        specs = []
        for i, layer in enumerate(self.layers):
            attn, mlp = layer.self_attn, layer.mlp
            names = ("q_proj", "k_proj", "v_proj", "o_proj")
            linears = tuple(getattr(attn, n, None) for n in names) + tuple(
                getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj"))
            if not all(isinstance(m, QuantLinear) for m in linears):
                return None, "not every linear layer is quantised"
            norms = [*self._norm_pairs(layer), getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)]
            if not all(n is None or "RMSNorm" in type(n).__name__ for n in norms) or not _lean_ok(attn):
                return None, f"layer {i}: unsupported norm or attention module"
            eps = {float(getattr(n, "variance_epsilon", getattr(n, "eps", 0.0))) for n in norms if n is not None}
            if len(eps) != 1:
                return None, "norms with different epsilons"
            weight = lambda n: None if n is None else n.weight  # noqa: E731
            spec = fused.FusedLayer(
                linears, *(weight(n) for n in norms), eps=eps.pop(), norm_offset=self.norm_offset,
                scaling=float(attn.scaling), n_heads=int(self.config.num_attention_heads),
                n_kv=int(getattr(self.config, "num_key_value_heads", None) or self.config.num_attention_heads),
                head_dim=int(attn.head_dim), activation=str(act), window=self.windows[i],
                rope_key=self.layer_types[i],
            )  # fmt: skip
            reason = fused.unsupported_reason(spec)
            if reason:
                return None, reason
            specs.append(spec)
        return specs, ""

    # -- the pieces -------------------------------------------------------------
    def linear_sublayers(self, i: int) -> dict[str, torch.nn.Linear]:
        """The linear layers of layer i by role (q, k, v, o; gate, up, down), for draft-only adapters."""
        layer = self.layers[i]
        names = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
                 "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}  # fmt: skip
        modules = dict(layer.named_modules())
        return {role: modules[name] for role, name in names.items() if name in modules}

    @property
    def hidden_size(self) -> int:
        return int(self.config.hidden_size)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.backbone.embed_tokens(input_ids)  # [1, T, H]

    def rotary(self, h: torch.Tensor, positions: torch.Tensor) -> dict[str, RotaryTable]:
        """cos and sin of each rotary kind at ``positions`` [1, T] (``h``: their dtype and device).  For static
        kinds the rows are looked up in tables the model's own rotary module made over positions 0..N once: its
        angles are element-wise (a position's products and cos / sin do not depend on the other positions of the
        call, checked in tests/test_rotary_rows.py), so a row is the one a call for its position alone gives, and a
        decoding step skips the module's dozen tensor operations (about 30-60 us of a 2-5 ms step)."""
        module = self.backbone.rotary_emb
        rope = getattr(module, "rope_type", None)
        kinds = rope.values() if isinstance(rope, dict) else [rope]
        n = int(positions.max()) + 1
        if n > ROTARY_MAX_ROWS or not all(k in STATIC_ROPE for k in kinds):
            return self._rotary_rows(h, positions)
        # the tables hold for these frequencies: a buffer replaced or changed in place (its version) remakes them
        key = (h.dtype, h.device, *((id(b), b._version) for b in module._buffers.values() if b is not None))
        cached = self.__dict__.get("_rotary_cache")
        if cached is None or cached[0] != key or cached[1] < n:
            size = -(-n // ROTARY_ROWS) * ROTARY_ROWS
            # ordinary constant tensors even inside a decoding's inference mode: S3D's training takes them in passes
            # that autograd records, which refuses tensors made in inference mode
            with torch.inference_mode(False), torch.no_grad():
                rows = torch.arange(size, device=h.device).view(1, -1)
                like = torch.zeros(1, 1, 1, dtype=h.dtype, device=h.device)
                cached = self.__dict__["_rotary_cache"] = (key, size, self._rotary_rows(like, rows))
        if positions.numel() == 1:  # a decoding step: views of one row
            p = int(positions)
            return {k: (c[:, p : p + 1], s[:, p : p + 1]) for k, (c, s) in cached[2].items()}
        at = positions.reshape(-1)
        return {k: (c[:, at], s[:, at]) for k, (c, s) in cached[2].items()}

    def _rotary_rows(self, h: torch.Tensor, positions: torch.Tensor) -> dict[str, RotaryTable]:
        """The model's rotary module at ``positions`` (each kind of layer its own: Gemma 3's local and global)."""
        return {"default": self.backbone.rotary_emb(h, positions)}

    def attention(self, i: int, h: torch.Tensor, rope: RotaryTable, mask, kv) -> torch.Tensor:
        layer = self.layers[i]
        return h + self._attend(layer.self_attn, layer.input_layernorm(h), rope, mask, kv)

    def _attend(self, attn, x: torch.Tensor, rope: RotaryTable, mask, kv) -> torch.Tensor:
        """The attention module's output for ``x``: its own forward, or (``lean_attention``) the same torch
        operations in the same order without the Python plumbing around them (a third of a small model's step
        on 2 CPU cores); tests check the two agree bit for bit."""
        if not self.lean_attention:
            out, _ = attn(hidden_states=x, position_embeddings=rope, attention_mask=mask, **{self._cache_kw: kv})
            return out
        return _lean_attention(attn, x, rope, mask, kv)

    def mlp(self, i: int, h: torch.Tensor) -> torch.Tensor:
        layer = self.layers[i]
        return h + layer.mlp(layer.post_attention_layernorm(h))

    def head(self, h: torch.Tensor, native_norm: bool = False) -> torch.Tensor:
        return self._softcap(self.lm_head(self.final_norm(h, native_norm)))

    def final_norm(self, h: torch.Tensor, native: bool = False) -> torch.Tensor:
        """The model's last norm, before the head.  ``native`` (the engine's passes on the fused stack): computed
        as the stack computes its own norms, in one native call, where the model's module makes six torch
        operations on a decoding step's row (2% of SmolLM2's step); the module where the native code cannot
        take it (weights or rows not float32 on the CPU, autograd) or is not asked to."""
        norm = self.backbone.norm
        if native and "RMSNorm" in type(norm).__name__:
            eps = float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 0.0)))
            out = fused.rms_norm(h, norm.weight, self.norm_offset, eps)
            if out is not None:
                return out
        return norm(h)

    def _softcap(self, logits: torch.Tensor) -> torch.Tensor:
        cap = getattr(self.config, "final_logit_softcapping", None)
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def quantized_head(self):
        """The LM head's weight when it is kept quantised without a bias (a :class:`QuantWeight`), else None."""
        weight = getattr(self.lm_head, "qweight", None)
        return weight if weight is not None and getattr(self.lm_head, "bias", None) is None else None

    def draft_head(self, h: torch.Tensor, vocab, native_norm: bool = False) -> torch.Tensor:
        """Logits ``[T, vocab.size]`` of the rows of a :class:`DraftVocabulary` only (drafts), for h ``[1, T, H]``."""
        x = self.final_norm(h, native_norm)[0]
        return self._softcap(vocab.product(x))


class Gemma3Adapter(LlamaAdapter):
    """Gemma 3 text models: norms before *and* after each sublayer, two RoPE bases."""

    model_types = ("gemma3_text",)

    norm_offset = 1.0

    def _layer_type_keys(self) -> list[str]:
        return list(self.config.layer_types[: self.num_layers])

    def _norm_pairs(self, layer) -> tuple:
        return (layer.input_layernorm, layer.post_attention_layernorm, layer.pre_feedforward_layernorm,
                layer.post_feedforward_layernorm)  # fmt: skip

    def _check_supported(self, layer) -> None:
        super()._check_supported(layer)
        for name in ("pre_feedforward_layernorm", "post_feedforward_layernorm"):
            if not hasattr(layer, name):
                raise UnsupportedModelError(f"gemma3: decoder layer has no '{name}'")

    def _rotary_rows(self, h: torch.Tensor, positions: torch.Tensor) -> dict[str, RotaryTable]:
        return {t: self.backbone.rotary_emb(h, positions, t) for t in set(self.layer_types)}

    def attention(self, i: int, h: torch.Tensor, rope: RotaryTable, mask, kv) -> torch.Tensor:
        layer = self.layers[i]
        return h + layer.post_attention_layernorm(self._attend(layer.self_attn, layer.input_layernorm(h), rope, mask,
                                                               kv))  # fmt: skip

    def mlp(self, i: int, h: torch.Tensor) -> torch.Tensor:
        layer = self.layers[i]
        return h + layer.post_feedforward_layernorm(layer.mlp(layer.pre_feedforward_layernorm(h)))


def _lean_ok(attn) -> bool:
    """Whether :func:`_lean_attention` reproduces this attention module (else its own forward runs)."""
    needed = ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "scaling", "num_key_value_groups", "layer_idx")
    return (all(hasattr(attn, a) for a in needed) and not getattr(attn, "attn_logit_softcapping", None)
            and not getattr(attn, "training", False) and getattr(attn, "is_causal", True))  # fmt: skip


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _lean_attention(attn, x: torch.Tensor, rope: RotaryTable, mask, kv) -> torch.Tensor:
    """transformers' attention forward with SDPA for batch 1 and no dropout (Llama, Mistral, Qwen2/3, Gemma 3):
    projections, optional query/key norms, rotary embedding, cache write, grouped-query SDPA as transformers
    dispatches it (``enable_gqa`` without a mask, packed heads for one query, repeated keys otherwise)."""
    T, hd = x.shape[1], attn.head_dim
    q = attn.q_proj(x).view(1, T, -1, hd).transpose(1, 2)
    k = attn.k_proj(x).view(1, T, -1, hd).transpose(1, 2)
    v = attn.v_proj(x).view(1, T, -1, hd).transpose(1, 2)
    if hasattr(attn, "q_norm"):
        q, k = attn.q_norm(q), attn.k_norm(k)
    cos, sin = rope[0].unsqueeze(1), rope[1].unsqueeze(1)
    q = (q * cos) + (_rotate_half(q) * sin)
    k = (k * cos) + (_rotate_half(k) * sin)
    k, v = kv.update(k, v, attn.layer_idx)
    groups = attn.num_key_value_groups
    extra = {}
    if groups > 1:
        if mask is None and k.shape[-1] == v.shape[-1] <= 256:
            extra["enable_gqa"] = True
        elif T == 1:
            q = q.reshape(1, q.shape[1] // groups, groups, hd)
        else:
            b, h, s, d = k.shape
            k = k[:, :, None].expand(b, h, groups, s, d).reshape(b, h * groups, s, d)
            v = v[:, :, None].expand(b, h, groups, s, v.shape[-1]).reshape(b, h * groups, s, v.shape[-1])
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0, scale=attn.scaling,
                                         is_causal=T > 1 and mask is None, **extra)  # fmt: skip
    out = out.reshape(1, -1, T, v.shape[-1]).transpose(1, 2).contiguous()
    return attn.o_proj(out.reshape(1, T, -1).contiguous())


ADAPTERS: tuple[type[LlamaAdapter], ...] = (LlamaAdapter, Gemma3Adapter)
SUPPORTED_MODEL_TYPES = tuple(t for a in ADAPTERS for t in a.model_types)


def adapter_for(model: Any) -> LlamaAdapter:
    """Pick the adapter for a loaded HF causal LM, or raise a clear error."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    for cls in ADAPTERS:
        if model_type in cls.model_types:
            return cls(model)
    raise UnsupportedModelError(
        f"unsupported architecture '{model_type}'; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
    )
