"""S3D: skippy simultaneous speculative decoding (Zhong & Bharadwaj 2024), with draft-only adapters.

The draft model is the full model with its middle layers ``[skip_from,
skip_to)`` left out (attention and MLP), fed with the last accepted token
followed by ``gamma - 1`` mask tokens: one draft pass predicts ``gamma``
tokens at once (paper eq. 5-8).  Below and above the gap the draft attends to
the keys and values the full model committed for every earlier position, so
only the new tokens lack the middle layers.

Unlike the paper, nothing of the model itself is trained: the mask token is a
learned input vector (not a vocabulary entry, so the full model's output
layer is unchanged) and the kept layers get low-rank adapters (LoRA) that
are switched on only inside draft passes (:func:`selfspec.core.kernels.draft_adapters`).
Verification runs the untouched model, so decoding stays exactly lossless.

Training (paper eq. 9) lives in :mod:`selfspec.train.s3d`; the paper's
speed model in :mod:`selfspec.train.s3d_speed`.  The adapter directory holds
``adapter.pt`` (weights, loaded with ``weights_only=True``) and
``config.json`` (format version, the model it belongs to, skip range, gamma,
rank, training facts).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..core.sampling import GREEDY_SAMPLER, Sampler
from ..core.skipset import SkipSet
from ..decoding.protocols import DraftOutcome
from ..decoding.trees import DraftTree
from ..errors import InvalidInputError
from ..io import atomic_write, atomic_write_text, check_version, load_tensors, read_json
from .layerskip import Drafter, FixedDraftLength, broken_draft

ADAPTER_VERSION = 1
ROLES = ("q", "k", "v", "o", "gate", "up", "down")


@dataclass(frozen=True)
class S3DConfig:
    skip_from: int  # first skipped layer (0-based); layers [0, skip_from) run (the paper's 1..m)
    skip_to: int  # one past the last skipped layer; layers [skip_to, L) run (the paper's n..L)
    gamma: int = 4  # tokens per draft pass: the root plus gamma - 1 mask tokens (paper optimum 4)
    rank: int = 8
    lora_alpha: float = 16.0

    @staticmethod
    def default(num_layers: int, gamma: int = 4) -> S3DConfig:
        """The paper's optimum: skip about half of the layers, symmetrically around the middle (beta 0.5)."""
        skipped = num_layers // 2
        start = (num_layers - skipped) // 2
        return S3DConfig(start, start + skipped, gamma)

    def check(self, num_layers: int) -> None:
        if not 0 < self.skip_from < self.skip_to < num_layers:
            raise InvalidInputError(
                f"S3D skip range [{self.skip_from}, {self.skip_to}) must leave at least one layer below and above "
                f"(model has {num_layers} layers)"
            )
        if not 1 <= self.gamma <= 16:
            raise InvalidInputError(f"gamma must be in 1..16, got {self.gamma}")
        if self.rank < 1:
            raise InvalidInputError(f"rank must be >= 1, got {self.rank}")

    def skip_set(self) -> SkipSet:
        middle = list(range(self.skip_from, self.skip_to))
        return SkipSet.of(middle, middle)

    def kept_layers(self, num_layers: int) -> list[int]:
        return [i for i in range(num_layers) if not self.skip_from <= i < self.skip_to]

    def beta(self, num_layers: int) -> float:
        """Share of the layers the draft runs (the paper's target ratio beta, by layer count)."""
        return len(self.kept_layers(num_layers)) / num_layers


def model_key(model) -> str:
    cfg = model.hf.config
    return f"{model.name}|{cfg.model_type}|{model.num_layers}|{model.adapter.hidden_size}"


class S3DAdapter(nn.Module):
    """The trained draft-only parameters: the mask token's input vector and LoRA pairs of the kept layers."""

    def __init__(self, model, config: S3DConfig, *, seed: int = 0) -> None:
        super().__init__()
        config.check(model.num_layers)
        self.config = config
        self.key = model_key(model)
        adapter = model.adapter
        with torch.no_grad():  # start from the mean input vector (embedding scaling included, e.g. Gemma's)
            some = torch.arange(min(adapter.vocab_size, 4096), device=model.engine.device)
            mean = adapter.embed(some.view(1, -1))[0].float().mean(0)
        self.mask_embedding = nn.Parameter(mean.cpu().clone())  # [H]
        gen = torch.Generator().manual_seed(seed)
        self.lora_a = nn.ParameterDict()
        self.lora_b = nn.ParameterDict()
        self._modules_by_name: dict[str, nn.Module] = {}
        for i in config.kept_layers(model.num_layers):
            for role, lin in adapter.linear_sublayers(i).items():
                name = f"{i}_{role}"
                a = torch.randn(config.rank, lin.in_features, generator=gen) / math.sqrt(lin.in_features)
                self.lora_a[name] = nn.Parameter(a)
                self.lora_b[name] = nn.Parameter(torch.zeros(lin.out_features, config.rank))  # starts as a no-op
                self._modules_by_name[name] = lin
        self.meta: dict[str, Any] = {}

    @property
    def scale(self) -> float:
        return self.config.lora_alpha / self.config.rank

    def draft_adapters(self) -> dict:
        """{linear module: (A, B, scale)} for :func:`selfspec.core.kernels.draft_adapters`."""
        s = self.scale
        return {mod: (self.lora_a[n], self.lora_b[n], s) for n, mod in self._modules_by_name.items()}

    def inputs(self, model, root_ids: torch.Tensor, g: int) -> torch.Tensor:
        """Input vectors ``[B * g, H]`` of B blocks: each root token's embedding, then g - 1 mask vectors."""
        emb = model.adapter.embed(root_ids.view(1, -1))[0]  # [B, H]
        mask = self.mask_embedding.to(emb.dtype).expand(emb.shape[0], g - 1, -1)
        return torch.cat([emb[:, None, :], mask], dim=1).reshape(-1, emb.shape[-1])

    # -- files ------------------------------------------------------------------------------------
    def save(self, out_dir: Path) -> None:
        out_dir.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().cpu() for k, v in self.state_dict().items()}
        atomic_write(out_dir / "adapter.pt", lambda f: torch.save(state, f))
        meta = {"version": ADAPTER_VERSION, "model": self.key, "config": asdict(self.config), **self.meta}
        atomic_write_text(out_dir / "config.json", json.dumps(meta, indent=1) + "\n")

    @staticmethod
    def load(model, path: str | Path) -> S3DAdapter:
        d = Path(path)
        cfg_file, weights = d / "config.json", d / "adapter.pt"
        if not cfg_file.is_file() or not weights.is_file():
            raise InvalidInputError(f"'{d}' is not an S3D adapter directory (train one with `selfspec train-s3d`)")
        meta = read_json(cfg_file, what="S3D adapter config")
        check_version(meta, cfg_file, what="S3D adapter config", version=ADAPTER_VERSION)
        try:
            config = S3DConfig(**meta["config"])
        except (KeyError, TypeError) as exc:
            raise InvalidInputError(f"S3D adapter config {cfg_file} is unreadable ({exc})") from None
        state = load_tensors(weights, what="S3D adapter weights")
        if meta.get("model") != model_key(model):
            raise InvalidInputError(f"S3D adapter '{d}' was trained for {meta.get('model')}, not {model_key(model)}")
        adapter = S3DAdapter(model, config)
        adapter.load_state_dict(state)
        adapter.meta = {k: v for k, v in meta.items() if k not in ("version", "model", "config")}
        return adapter.to(model.engine.device)


# -- drafting ----------------------------------------------------------------------------------


@dataclass
class S3DDrafter(Drafter):
    """One draft pass per round: the root and gamma - 1 mask tokens through the kept layers."""

    s3d: S3DAdapter | None = None
    source: str | Path | None = None
    _mapping: dict | None = field(default=None, repr=False)

    def adapter_for(self, model) -> S3DAdapter:
        if self.s3d is None:
            if self.source is None:
                raise InvalidInputError("method 's3d' needs an adapter (adapter=DIR; `selfspec train-s3d` makes one)")
            self.s3d = S3DAdapter.load(model, self.source)
        elif self.s3d.key != model_key(model):
            raise InvalidInputError(f"this S3D adapter was trained for {self.s3d.key}, not {model_key(model)}")
        if self._mapping is None:
            self._mapping = self.s3d.draft_adapters()
        return self.s3d

    @torch.inference_mode()
    def draft(self, model, cache, start, root, skip, budget, sampler: Sampler = GREEDY_SAMPLER, history=(),
              until=None, ride=None):  # fmt: skip
        """One pass drafts the whole block of mask tokens (``until``, a chain's early end, and ``ride``, guessed
        rows, do not apply)."""
        if budget < 1:
            return None
        s3d = self.adapter_for(model)
        g = min(self.max_draft, budget)
        embeds = s3d.inputs(model, torch.tensor([root], device=model.engine.device), g)  # [g, H]
        ids = torch.full((g,), root, dtype=torch.long, device=model.engine.device)  # (only their count matters)
        logits = model.engine.forward(cache, ids, start, skip=skip, input_embeds=embeds, adapters=self._mapping,
                                      precision=self.torch_dtype(model))  # fmt: skip
        if broken_draft(logits):
            return None  # a broken draft pass: this round decodes plainly
        tokens, qs, probs = [root], [], []
        first_t = sampler.position(len(history))
        for j in range(g):
            q = sampler.draft_distribution(logits[j], sampler.extend(history, tokens[1:]))
            tok = sampler.draft_tokens(q, 1, t=first_t + j)[0]
            tokens.append(tok)
            qs.append(q)
            probs.append(float(q[tok]))
        tree = DraftTree(tuple(tokens), tuple(range(-1, g)), tuple(qs) + (None,) if sampler.records_q else ())
        return DraftOutcome(tree, probs, {}, steps=g, passes=1)


def s3d_drafter(options: dict[str, Any]) -> S3DDrafter:
    adapter = options.get("adapter")
    gamma = options.get("gamma")
    s3d = adapter if isinstance(adapter, S3DAdapter) else None
    source = None if s3d is not None else adapter
    if s3d is None and source is None:
        raise InvalidInputError("method 's3d' needs an adapter (adapter=DIR; `selfspec train-s3d` makes one)")
    if gamma is None:
        if s3d is not None:
            gamma = s3d.config.gamma
        else:
            try:
                gamma = json.loads((Path(source) / "config.json").read_text())["config"]["gamma"]
            except (OSError, ValueError, KeyError, TypeError):
                raise InvalidInputError(f"'{source}' is not an S3D adapter directory") from None
    gamma = int(gamma)
    if not 1 <= gamma <= 16:
        raise InvalidInputError(f"gamma must be in 1..16, got {gamma}")
    return S3DDrafter(FixedDraftLength(gamma), None, str(options.get("draft_dtype", "auto")), s3d=s3d, source=source)


class S3DSkipPolicy:
    """The adapter's middle-layer gap, known once the drafter has loaded the adapter."""

    def __init__(self) -> None:
        self._skip: SkipSet | None = None

    def bind(self, model, drafter) -> None:
        self._skip = drafter.adapter_for(model).config.skip_set()

    def propose(self, cosine, num_layers: int) -> SkipSet:
        assert self._skip is not None, "bind() first"
        return self._skip

    def observe(self, drafted: int, accepted: int) -> None:
        pass
