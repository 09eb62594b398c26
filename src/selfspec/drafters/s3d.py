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
are switched on only inside draft passes (:func:`selfspec.kernels.draft_adapters`).
Verification runs the untouched model, so decoding stays exactly lossless.

Training (paper eq. 9) runs on a CPU in minutes: self-distillation on text
the model itself generates greedily from prompts of the offline datasets
(prompts not used by the benchmarks' default slices), blocks of ``gamma``
positions at random places of each text, the mean cross-entropy of the
block's predictions against the text's next tokens::

    selfspec train-s3d --model smollm2-135m --out adapters/s3d-smollm2 --steps 300
    selfspec generate --method s3d --adapter adapters/s3d-smollm2 --prompt "..." --compare

The adapter directory holds ``adapter.pt`` (weights), ``config.json`` (the
model it belongs to, skip range, gamma, rank, the data used, steps, final
loss), ``loss.png`` (the loss curve), ``data.jsonl`` (the self-distilled
texts) and ``checkpoint.pt`` (optimiser state; rerunning resumes).

The paper's speed model lives in :mod:`selfspec.s3d_model`.
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..core import kernels
from .layerskip import Drafter, DraftOutcome, FixedDraftLength
from ..errors import InvalidInputError
from ..core.sampling import GREEDY, SamplingParams, sample, warp
from ..core.skipset import SkipSet
from ..decoding.trees import DraftTree

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
        """{linear module: (A, B, scale)} for :func:`selfspec.kernels.draft_adapters`."""
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
        torch.save({k: v.detach().cpu() for k, v in self.state_dict().items()}, out_dir / "adapter.pt")
        meta = {"version": ADAPTER_VERSION, "model": self.key, "config": asdict(self.config), **self.meta}
        (out_dir / "config.json").write_text(json.dumps(meta, indent=1) + "\n")

    @staticmethod
    def load(model, path: str | Path) -> S3DAdapter:
        d = Path(path)
        cfg_file, weights = d / "config.json", d / "adapter.pt"
        if not cfg_file.is_file() or not weights.is_file():
            raise InvalidInputError(f"'{d}' is not an S3D adapter directory (train one with `selfspec train-s3d`)")
        try:
            meta = json.loads(cfg_file.read_text())
            config = S3DConfig(**meta["config"])
            state = torch.load(weights, map_location="cpu", weights_only=True)
        except (OSError, ValueError, KeyError, TypeError, RuntimeError) as exc:
            raise InvalidInputError(f"S3D adapter '{d}' is unreadable ({exc})") from None
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
    def draft(self, model, cache, start, root, skip, budget, sampling: SamplingParams = GREEDY, generator=None):
        if budget < 1:
            return None
        s3d = self.adapter_for(model)
        g = min(self.max_draft, budget)
        embeds = s3d.inputs(model, torch.tensor([root], device=model.engine.device), g)  # [g, H]
        ids = torch.full((g,), root, dtype=torch.long, device=model.engine.device)  # (only their count matters)
        logits = model.engine.forward(cache, ids, start, skip=skip, input_embeds=embeds, adapters=self._mapping,
                                      precision=self.torch_dtype(model))  # fmt: skip
        tokens, qs, probs = [root], [], []
        for j in range(g):
            if sampling.greedy:
                q = logits[j].float().softmax(-1)
                tok = int(q.argmax())
            else:
                q = warp(logits[j], sampling)
                tok = sample(q, generator)
            tokens.append(tok)
            qs.append(q)
            probs.append(float(q[tok]))
        tree = DraftTree(tuple(tokens), tuple(range(-1, g)), tuple(qs) + (None,))
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


# -- training ----------------------------------------------------------------------------------

TRAIN_SOURCES = (("xsum", 100), ("humaneval", 100), ("mtbench", 40))  # (dataset, offset): away from bench slices


def self_distill(model, path: Path, *, prompts: int, new_tokens: int, progress: bool = True) -> list[dict]:
    """Texts = prompt + the model's own greedy continuation; cached in ``path`` (JSONL), extended if short."""
    from ..api import generate
    from ..datasets import load_prompts

    rows: list[dict] = []
    if path.is_file():
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if r.get("new_tokens") == new_tokens]
    if len(rows) >= prompts:
        return rows[:prompts]
    pools = []
    for name, offset in TRAIN_SOURCES:
        try:
            pools.append(load_prompts(name, limit=prompts, chat=model.has_chat_template, offset=offset))
        except InvalidInputError:
            continue  # a dataset with fewer prompts: the others fill in
    done = {r["id"] for r in rows}
    candidates = [pool[i] for i in range(prompts) for pool in pools if i < len(pool)]  # round robin over sources
    bar = _bar(prompts - len(rows), "self-distillation texts", progress)
    for it in candidates:
        if len(rows) >= prompts:
            break
        if it.id in done:
            continue
        ids = model.encode(it.prompt)
        if len(ids) + new_tokens + 8 > model.max_context:
            continue  # too long for the model: the next candidate
        out = generate(model, it.prompt, "vanilla", max_new_tokens=new_tokens)
        rows.append({"id": it.id, "task": it.task, "prompt_ids": ids, "ids": list(out.token_ids),
                     "new_tokens": new_tokens})  # fmt: skip
        with path.open("a") as f:
            f.write(json.dumps(rows[-1]) + "\n")
        bar.update(1)
    bar.close()
    if not rows:
        raise InvalidInputError("no training text could be made (every prompt too long for the model?)")
    return rows


def _bar(total: int, desc: str, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, disable=not enabled, dynamic_ncols=True)


@dataclass
class TrainResult:
    steps: int
    losses: list[float]
    seconds: float
    out_dir: Path


def train_s3d(
    model,
    out_dir: str | Path,
    *,
    steps: int = 300,
    config: S3DConfig | None = None,
    lr: float = 2e-3,
    blocks: int = 8,
    prompts: int = 24,
    new_tokens: int = 64,
    seed: int = 0,
    checkpoint_every: int = 50,
    progress: bool = True,
) -> TrainResult:
    """Train (or resume training) an S3D adapter into ``out_dir``; see the module docstring."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if steps < 1:
        raise InvalidInputError(f"steps must be >= 1, got {steps}")
    if blocks < 1:
        raise InvalidInputError(f"blocks must be >= 1, got {blocks}")
    ckpt_path = out / "checkpoint.pt"
    ckpt = torch.load(ckpt_path, map_location="cpu", weights_only=False) if ckpt_path.is_file() else None
    if ckpt is not None:
        config = S3DConfig(**ckpt["config"])
    config = config or S3DConfig.default(model.num_layers)
    config.check(model.num_layers)
    g = config.gamma

    texts = self_distill(model, out / "data.jsonl", prompts=prompts, new_tokens=new_tokens, progress=progress)
    texts = [t for t in texts if len(t["ids"]) > g]
    if not texts:
        raise InvalidInputError("the self-distilled texts are too short to train on")

    adapter = S3DAdapter(model, config, seed=seed).to(model.engine.device)
    for p in model.hf.parameters():
        p.requires_grad_(False)
    opt = torch.optim.AdamW(adapter.parameters(), lr=lr, weight_decay=0.0)
    losses: list[float] = []
    start_step, seconds = 0, 0.0
    if ckpt is not None:
        if ckpt.get("model") != model_key(model):
            raise InvalidInputError(f"checkpoint in '{out}' belongs to {ckpt.get('model')}, not {model_key(model)}")
        adapter.load_state_dict(ckpt["adapter"])
        opt.load_state_dict(ckpt["optimizer"])
        losses, start_step, seconds = list(ckpt["losses"]), int(ckpt["step"]), float(ckpt["seconds"])
    rng = random.Random(seed * 1000003 + start_step)
    skip = config.skip_set()
    engine = model.engine
    prefixes: dict[int, tuple[Any, int]] = {}

    def prefix(idx: int):
        if idx not in prefixes:  # the full model's keys and values of the whole text, computed once
            t = texts[idx]
            ids = t["prompt_ids"] + t["ids"]
            cache = engine.new_cache(len(ids))
            engine.forward(cache, torch.tensor(ids, device=engine.device), 0, last_only=True)
            cache.commit(len(ids))
            prefixes[idx] = (cache, len(t["prompt_ids"]))
        return prefixes[idx]

    def save(step: int) -> None:
        adapter.meta = {"steps": step, "final_loss": sum(losses[-20:]) / max(1, len(losses[-20:])),
                        "train_seconds": round(seconds, 1), "texts": len(texts), "new_tokens": new_tokens,
                        "data": "self-distilled: the model's greedy continuations of "
                                + ", ".join(f"{n} (from prompt {o})" for n, o in TRAIN_SOURCES),
                        "lr": lr, "blocks": blocks, "seed": seed}  # fmt: skip
        adapter.save(out)
        torch.save({"config": asdict(config), "model": model_key(model), "adapter": adapter.state_dict(),
                    "optimizer": opt.state_dict(), "losses": losses, "step": step, "seconds": seconds},
                   ckpt_path)  # fmt: skip
        plot_losses(losses, out / "loss.png", title=f"S3D training, {model.name}, skip {config.skip_from}-"
                    f"{config.skip_to - 1}, gamma {g}")  # fmt: skip

    bar = _bar(steps - start_step, "train-s3d", progress)
    step = start_step
    for step in range(start_step + 1, steps + 1):
        t0 = time.perf_counter()
        idx = rng.randrange(len(texts))
        cache, p_len = prefix(idx)
        full = texts[idx]["prompt_ids"] + texts[idx]["ids"]
        # roots: the last prompt token or a generated one, with g generated tokens after it
        lo, hi = p_len - 1, len(full) - g - 1
        roots = sorted(rng.sample(range(lo, hi + 1), min(blocks, hi - lo + 1)))
        loss = _block_loss(engine, model, adapter, cache, full, roots, g, skip)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
        seconds += time.perf_counter() - t0
        bar.update(1)
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
        if step % checkpoint_every == 0 or step == steps:
            save(step)
    bar.close()
    if step == start_step:  # nothing left to do: still write the files
        save(step)
    return TrainResult(step, losses, seconds, out)


def _block_loss(engine, model, adapter: S3DAdapter, cache, full: list[int], roots: list[int], g: int, skip):
    """Eq. 9: mean cross-entropy of every block's g predictions against the text's next g tokens."""
    device = engine.device
    n = len(full)
    T = len(roots) * g
    root_ids = torch.tensor([full[r] for r in roots], device=device)
    with kernels.draft_adapters(adapter.draft_adapters()):
        embeds = adapter.inputs(model, root_ids, g)  # [T, H]
        positions = torch.tensor([r + j for r in roots for j in range(g)], device=device)
        attend = torch.zeros(T, n + T, dtype=torch.bool, device=device)
        for b, r in enumerate(roots):
            rows = slice(b * g, (b + 1) * g)
            attend[rows, :r] = True  # the full model's entries before the root
            attend[rows, n + b * g : n + (b + 1) * g] = torch.ones(g, g, dtype=torch.bool, device=device).tril()
        logits = engine.forward_train(cache, n, embeds, positions, attend, skip)  # [T, V]
    targets = torch.tensor([full[r + 1 + j] for r in roots for j in range(g)], device=device)
    return F.cross_entropy(logits.float(), targets)


def plot_losses(losses: list[float], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(range(1, len(losses) + 1), losses, lw=0.8, alpha=0.5, label="step")
    w = 20
    if len(losses) >= w:
        smooth = [sum(losses[i - w : i]) / w for i in range(w, len(losses) + 1)]
        ax.plot(range(w, len(losses) + 1), smooth, lw=2, label=f"mean of {w}")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (eq. 9)")
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
