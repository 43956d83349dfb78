"""`specd distill` settings: DistillConfig (one field per flag), its checks, and the device to train on."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoConfig

from specd.core.errors import InvalidArgument
from specd.tools.distill.model import layers_key

CHECKPOINT = "checkpoint.pt"
SOURCES = ("generations", "continuations", "stdlib", "shakespeare", "fortunes")
DATA_VERSION = 1  # bump when cached teacher data changes meaning


def is_generated(source: str) -> bool:
    """Sources made of the target's own continuations (vs. text corpora)."""
    return source in ("generations", "continuations") or source.startswith("prompts:")


@dataclass
class DistillConfig:
    """Everything `specd distill` needs; one field per command-line flag."""

    target: Path
    out: Path
    work_dir: Path | None = None  # default: OUT/work
    layers: int = 3  # transformer layers of the draft
    init: str = "target"  # "target": first layers of the target; "random"
    vocab: int = 8192  # reduced head size (0: the full vocabulary)
    train_head: bool = False
    sources: list[str] = field(default_factory=lambda: ["generations", "stdlib", "shakespeare"])
    prompts: str = "builtin"  # "builtin" or a file (.json list / {"prompts": [...]}, or one prompt a line)
    num_prompts: int = 512  # prompts the target answers (generations)
    gen_tokens: int = 128  # new tokens per prompt
    gen_batch: int = 16
    gen_temperature: float = 0.0  # 0: greedy continuations (what greedy serving is asked to predict)
    gen_minutes: float = 0.0  # stop generating after this long and train on what is there (0: no limit)
    num_continuations: int = 256  # plain-text openings (prose, code) the target continues (continuations)
    chat: bool = True  # wrap prompts in the target's chat template (when it has one)
    corpus_tokens: int = 20_000  # tokens per text corpus
    teacher_top_k: int = 32
    teacher_dtype: str = "float32"  # float32 or bfloat16 (faster on CPUs with AMX/AVX512-BF16)
    seq_len: int = 384
    batch_size: int = 8  # sequences per step
    steps: int = 1000
    train_minutes: float = 0.0  # also stop (and anneal the learning rate) by time (0: steps only)
    lr: float = 5e-4
    warmup: int = 50
    weight_decay: float = 0.0
    autocast: str = "auto"  # bfloat16 autocast: auto / on / off
    val_fraction: float = 0.05
    eval_every: int = 100
    checkpoint_every: int = 100
    resume: bool = False
    device: str = "auto"  # auto: cuda when there is one, else cpu
    threads: int = 0  # torch intra-op threads (0: torch's default)
    seed: int = 0
    progress: bool = True

    def validate(self) -> DistillConfig:
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise InvalidArgument(msg)

        need(self.layers >= 1, f"--layers must be >= 1 (got {self.layers})")
        need(self.init in ("target", "random"), f"--init must be 'target' or 'random' (got {self.init!r})")
        need(self.vocab >= 0, "--vocab must be >= 0 (0: the full vocabulary)")
        need(bool(self.sources), "give at least one --source")
        for s in self.sources:
            if s.startswith("prompts:"):
                need(Path(s[len("prompts:") :]).is_file(), f"--source {s!r}: no such prompt file")
            else:
                need(
                    s in SOURCES or Path(s).exists(), f"--source {s!r} is neither one of {SOURCES} nor an existing path"
                )
        need(
            self.num_prompts >= 1 and self.gen_tokens >= 1 and self.gen_batch >= 1,
            "prompt/generation sizes must be >= 1",
        )
        need(self.gen_temperature >= 0, "--gen-temperature must be >= 0")
        need(self.teacher_top_k >= 1, "--teacher-top-k must be >= 1")
        need(self.teacher_dtype in ("float32", "bfloat16"), "--teacher-dtype must be float32 or bfloat16")
        need(self.seq_len >= 8 and self.batch_size >= 1, "--seq-len must be >= 8 and --batch-size >= 1")
        need(self.steps >= 0 and self.lr > 0 and self.warmup >= 0, "--steps >= 0, --lr > 0, --warmup >= 0")
        need(self.autocast in ("auto", "on", "off"), "--autocast must be auto, on or off")
        need(0 <= self.val_fraction < 0.5, "--val-fraction must be in [0, 0.5)")
        need(self.eval_every >= 1 and self.checkpoint_every >= 1, "--eval-every and --checkpoint-every must be >= 1")
        need(self.threads >= 0, "--threads must be >= 0")
        if not (Path(self.target) / "config.json").is_file():
            raise InvalidArgument(f"--target {str(self.target)!r} is not a model folder (no config.json)")
        target_config = AutoConfig.from_pretrained(self.target, local_files_only=True)
        depth = getattr(target_config, layers_key(target_config))
        need(self.layers <= depth, f"--layers {self.layers} is more than the target's {depth}")
        return self

    @property
    def work(self) -> Path:
        return Path(self.work_dir) if self.work_dir else Path(self.out) / "work"

    def data_key(self, source: str) -> dict[str, object]:
        """The settings one source's cached data depends on (other settings are refused for it)."""
        key: dict[str, object] = {
            "version": DATA_VERSION,
            "source": source,
            "target": str(Path(self.target).resolve()),
            "teacher_top_k": self.teacher_top_k,
            "teacher_dtype": self.teacher_dtype,
            "seq_len": self.seq_len,
            "seed": self.seed,
        }
        if source == "generations":
            key.update(prompts=self.prompts, num_prompts=self.num_prompts, chat=self.chat)
        if source == "continuations":
            key.update(num_continuations=self.num_continuations)
        if source.startswith("prompts:"):
            key.update(chat=self.chat)
        if is_generated(source):
            key.update(gen_tokens=self.gen_tokens, gen_temperature=self.gen_temperature, gen_batch=self.gen_batch)
        else:
            key.update(corpus_tokens=self.corpus_tokens)
        return key

    def model_key(self) -> dict[str, object]:
        """The settings a checkpoint depends on (resuming with others is refused).

        Not the data: a resumed run may add sources (the token map of the first run is kept).
        """
        return {
            "layers": self.layers,
            "init": self.init,
            "vocab": self.vocab,
            "train_head": self.train_head,
            "seed": self.seed,
        }


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise InvalidArgument(f"--device {name!r}: {e}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise InvalidArgument("--device cuda: no CUDA device is available here; use --device cpu")
    return device


def bf16_ok(device: torch.device) -> bool:
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    try:  # oneDNN's bf16 kernels need AVX512-BF16 or AMX; elsewhere bf16 is emulated (slow)
        return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False
