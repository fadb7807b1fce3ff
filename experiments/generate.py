"""Sample text from a trained model, decoded through the tokenizer of the data it was trained on.

    python experiments/train.py --data data/mine --steps 300 --checkpoint-dir runs/mine --export-model
    python experiments/generate.py runs/mine/model.pt --data data/mine --max-new-tokens 200
    python experiments/generate.py runs/bytes/model.pt --prompt "def " --num-samples 3 --temperature 0.8 --top-k 40

The model is a run's consolidated export (``--export-model`` writes ``<checkpoint_dir>/model.pt``).
``--data`` names the corpus it was trained on (default ``stdlib``): a prepared directory's
tokenizer encodes the prompt and decodes the samples; a byte corpus decodes as UTF-8. Without
``--prompt`` the prompt is the first ``--prompt-tokens`` tokens of the validation split. Past the
model's context each token is predicted from the last ``max_seq_len`` tokens (nanoGPT's crop).
Routers that cannot decode from a KV cache (expert choice, sequence-sized capacity) sample by
recomputing every prefix, which is what serving them costs.
"""

from __future__ import annotations

import argparse
import sys

import torch

from moe.data import load_corpus
from moe.model import ModelConfig, MoETransformer


def load_export(path: str) -> MoETransformer:
    """The model of an ``export_model`` file ({"model": state dict, "model_config": fields}), in eval mode."""
    saved = torch.load(path, map_location="cpu", weights_only=False)
    model = MoETransformer(ModelConfig(**saved["model_config"]))
    model.load_state_dict(saved["model"])
    return model.eval()


def main(argv: list[str] | None = None) -> list[str]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("export", help="model.pt written by a run with --export-model")
    p.add_argument(
        "--data",
        default="stdlib",
        help="the corpus the model was trained on (a prepared directory, 'stdlib' or a text path; default: stdlib)",
    )
    p.add_argument("--prompt", help="prompt text (default: the start of the validation split)")
    p.add_argument("--prompt-tokens", type=int, default=32, help="tokens of the default prompt")
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    p.add_argument("--top-k", type=int, help="sample among the k most likely tokens")
    p.add_argument("--num-samples", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    model = load_export(args.export)
    corpus = load_corpus(args.data)
    if model.cfg.vocab_size != corpus.vocab_size:
        p.error(
            f"the model has vocab_size={model.cfg.vocab_size}, the data {args.data!r} {corpus.vocab_size}: "
            "pass the --data it was trained on"
        )
    prompt = corpus.encode(args.prompt) if args.prompt is not None else corpus.val[torch.arange(args.prompt_tokens)]
    prompt_BT = torch.as_tensor(prompt, dtype=torch.long).view(1, -1).expand(args.num_samples, -1)
    with torch.no_grad():
        out_BS = model.generate(
            prompt_BT,
            args.max_new_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            seed=args.seed,
            recompute=model.decode_support() is not None,
        )
    texts = [corpus.decode(row) for row in out_BS]
    for k, text in enumerate(texts):
        if args.num_samples > 1:
            print(f"--- sample {k + 1} ---")
        print(text)
    return texts


if __name__ == "__main__":
    main(sys.argv[1:])
