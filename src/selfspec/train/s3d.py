"""S3D training (paper eq. 9): self-distillation, then draft-only adapters trained on it.

Runs on a CPU in minutes: text the model itself generates greedily from
prompts of the offline datasets (prompts not used by the benchmarks' default
slices), blocks of ``gamma`` positions at random places of each text, the mean
cross-entropy of the block's predictions against the text's next tokens::

    selfspec train-s3d --model smollm2-135m --out adapters/s3d-smollm2 --steps 300
    selfspec generate --method s3d --adapter adapters/s3d-smollm2 --prompt "..." --compare

The output directory holds the adapter (``adapter.pt``, ``config.json``, see
:mod:`selfspec.drafters.s3d`), ``loss.png`` (the loss curve), ``data.jsonl``
(the self-distilled texts) and ``checkpoint.pt`` (optimiser state, versioned,
loaded with ``weights_only=True``; rerunning resumes).  Every file is written
atomically.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ..core import kernels
from ..drafters.s3d import S3DAdapter, S3DConfig, model_key
from ..errors import InvalidInputError
from ..io import atomic_write, atomic_write_text, check_version, load_tensors

CHECKPOINT_VERSION = 2  # 2: weights_only-loadable, with a version field

TRAIN_SOURCES = (("xsum", 100), ("humaneval", 100), ("mtbench", 40))  # (dataset, offset): away from bench slices


def self_distill(model, path: Path, *, prompts: int, new_tokens: int, progress: bool = True) -> list[dict]:
    """Texts = prompt + the model's own greedy continuation; cached in ``path`` (JSONL), extended if short."""
    from ..api import generate
    from ..datasets import load_prompts

    rows: list[dict] = []
    if path.is_file():
        try:
            rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        except ValueError as exc:
            raise InvalidInputError(f"self-distilled texts {path} are unreadable ({exc}); delete the file") from None
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
        # the whole file again (a few hundred kB at most): a crash mid-write leaves the previous one
        atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in rows))
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
    ckpt = _load_checkpoint(out / "checkpoint.pt", model)
    if ckpt is not None:
        config = S3DConfig(**ckpt["config"])
    config = config or S3DConfig.default(model.num_layers)
    config.check(model.num_layers)

    texts = self_distill(model, out / "data.jsonl", prompts=prompts, new_tokens=new_tokens, progress=progress)
    texts = [t for t in texts if len(t["ids"]) > config.gamma]
    if not texts:
        raise InvalidInputError("the self-distilled texts are too short to train on")

    adapter = S3DAdapter(model, config, seed=seed).to(model.engine.device)
    for p in model.hf.parameters():
        p.requires_grad_(False)
    opt = torch.optim.AdamW(adapter.parameters(), lr=lr, weight_decay=0.0)
    run = _Run(model, adapter, opt, config, out, texts,
               facts={"new_tokens": new_tokens, "lr": lr, "blocks": blocks, "seed": seed})  # fmt: skip
    if ckpt is not None:
        adapter.load_state_dict(ckpt["adapter"])
        opt.load_state_dict(ckpt["optimizer"])
        run.losses, run.step, run.seconds = list(ckpt["losses"]), int(ckpt["step"]), float(ckpt["seconds"])
    rng = random.Random(seed * 1000003 + run.step)

    bar = _bar(steps - run.step, "train-s3d", progress)
    start_step = run.step
    for step in range(start_step + 1, steps + 1):
        run.train_step(rng, blocks)
        bar.update(1)
        bar.set_postfix(loss=f"{run.losses[-1]:.3f}")
        if step % checkpoint_every == 0 or step == steps:
            run.save()
    bar.close()
    if run.step == start_step:  # nothing left to do: still write the files
        run.save()
    return TrainResult(run.step, run.losses, run.seconds, out)


def _load_checkpoint(path: Path, model) -> dict | None:
    if not path.is_file():
        return None
    ckpt = load_tensors(path, what="S3D training checkpoint")
    check_version(ckpt, path, what="S3D training checkpoint", version=CHECKPOINT_VERSION)
    if ckpt.get("model") != model_key(model):
        raise InvalidInputError(f"checkpoint {path} belongs to {ckpt.get('model')}, not {model_key(model)}")
    return ckpt


class _Run:
    """One training run's state: the step, the losses, the full model's cached prefixes."""

    def __init__(self, model, adapter: S3DAdapter, opt, config: S3DConfig, out: Path, texts: list[dict],
                 facts: dict[str, Any]) -> None:  # fmt: skip
        self.model, self.adapter, self.opt, self.config, self.out = model, adapter, opt, config, out
        self.texts, self.facts = texts, facts
        self.skip = config.skip_set()
        self.losses: list[float] = []
        self.step, self.seconds = 0, 0.0
        self._prefixes: dict[int, tuple[Any, int]] = {}

    def prefix(self, idx: int):
        if idx not in self._prefixes:  # the full model's keys and values of the whole text, computed once
            engine, t = self.model.engine, self.texts[idx]
            ids = t["prompt_ids"] + t["ids"]
            cache = engine.new_cache(len(ids))
            engine.forward(cache, torch.tensor(ids, device=engine.device), 0, last_only=True)
            cache.commit(len(ids))
            self._prefixes[idx] = (cache, len(t["prompt_ids"]))
        return self._prefixes[idx]

    def train_step(self, rng: random.Random, blocks: int) -> None:
        t0 = time.perf_counter()
        g = self.config.gamma
        idx = rng.randrange(len(self.texts))
        cache, p_len = self.prefix(idx)
        full = self.texts[idx]["prompt_ids"] + self.texts[idx]["ids"]
        # roots: the last prompt token or a generated one, with g generated tokens after it
        lo, hi = p_len - 1, len(full) - g - 1
        roots = sorted(rng.sample(range(lo, hi + 1), min(blocks, hi - lo + 1)))
        loss = _block_loss(self.model.engine, self.model, self.adapter, cache, full, roots, g, self.skip)
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        self.losses.append(float(loss.detach()))
        self.seconds += time.perf_counter() - t0
        self.step += 1

    def save(self) -> None:
        """Adapter, checkpoint and loss plot, each written atomically."""
        losses, config = self.losses, self.config
        self.adapter.meta = {"steps": self.step, "final_loss": sum(losses[-20:]) / max(1, len(losses[-20:])),
                             "train_seconds": round(self.seconds, 1), "texts": len(self.texts),
                             "new_tokens": self.facts["new_tokens"],
                             "data": "self-distilled: the model's greedy continuations of "
                                     + ", ".join(f"{n} (from prompt {o})" for n, o in TRAIN_SOURCES),
                             "lr": self.facts["lr"], "blocks": self.facts["blocks"],
                             "seed": self.facts["seed"]}  # fmt: skip
        self.adapter.save(self.out)
        ckpt = {"version": CHECKPOINT_VERSION, "config": asdict(config), "model": model_key(self.model),
                "adapter": self.adapter.state_dict(), "optimizer": self.opt.state_dict(), "losses": losses,
                "step": self.step, "seconds": self.seconds}  # fmt: skip
        atomic_write(self.out / "checkpoint.pt", lambda f: torch.save(ckpt, f))
        plot_losses(losses, self.out / "loss.png", title=f"S3D training, {self.model.name}, skip "
                    f"{config.skip_from}-{config.skip_to - 1}, gamma {config.gamma}")  # fmt: skip


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
