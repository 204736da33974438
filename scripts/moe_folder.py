"""A checkpoint folder of a named geometry for `bench_generate --random-weights`: config.json + a byte-level tokenizer.

  PYTHONPATH=. python3 scripts/moe_folder.py /tmp/moe35a3 [--geometry moe35a3] [--layers N]

The tokenizer (256 byte tokens, no merges, made with `tokenizers`) needs no download, so the folder can be made
on a machine without network; its ids fit any vocab of at least 256.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("folder")
    ap.add_argument("--geometry", default="moe35a3", help="a configs/*.json name")
    ap.add_argument("--layers", type=int, default=0, help="keep the first N layers (0 = all)")
    args = ap.parse_args()
    out = Path(args.folder)
    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((Path(__file__).parent.parent / "configs" / f"{args.geometry}.json").read_text())
    if args.layers:
        if "layer_types" in config:
            config["layer_types"] = config["layer_types"][: args.layers]
        config["num_hidden_layers"] = args.layers
    (out / "config.json").write_text(json.dumps(config, indent=1))
    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text("{}")
    print(f"{out}: {args.geometry}, {config['num_hidden_layers']} layers, byte-level tokenizer")


if __name__ == "__main__":
    main()
