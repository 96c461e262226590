"""Compare dense streaming, DIP and DIP-CA on one prompt against the same model held in RAM.

Each method is one `FlashConfig`: `method="dense"` streams every MLP unit (exact), `method="dip"` with a
`density` below 1 prunes MLP inputs and down columns, and `cache_aware=0.2` makes it DIP-CA, which favours
units already in the cache. Prints tokens/s, MB read from the store per token and whether the greedy
tokens equal the in-RAM model's (dense streaming must; the sparse methods approximate). DIP uses the
store's calibrated density split when there is one (examples/calibrate.py), an equal split otherwise.

    python examples/compare_methods.py                     # SmolLM2-135M-Instruct, density 0.7
    python examples/compare_methods.py --density 0.5 --new-tokens 64 --memory-budget 25%
"""

import time
from argparse import ArgumentParser, RawDescriptionHelpFormatter

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import flashlm
from flashlm.data.models import model_path


def greedy(model, inputs, new_tokens: int) -> tuple[torch.Tensor, float]:
    started = time.perf_counter()
    out = model.generate(**inputs, max_new_tokens=new_tokens, do_sample=False)
    return out[0, inputs["input_ids"].shape[1] :], time.perf_counter() - started


def main() -> None:
    parser = ArgumentParser(description=__doc__, formatter_class=RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a bundled model's name or a checkpoint directory (default: SmolLM2)")
    parser.add_argument("--store", help="store directory (default: one in flashlm's cache)")
    parser.add_argument("--density", type=float, default=0.7, help="MLP density of DIP and DIP-CA")
    parser.add_argument("--memory-budget", default="50%", help="cache: '50%%' of the MLP bytes, or '64MB'")
    parser.add_argument("--prompt", default="The capital of France is")
    parser.add_argument("--new-tokens", type=int, default=32)
    args = parser.parse_args()

    path = model_path(args.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    inputs = tokenizer(args.prompt, return_tensors="pt")
    in_ram = AutoModelForCausalLM.from_pretrained(path)
    greedy(in_ram, inputs, 1)  # warm-up: torch's one-time costs out of the first timing
    reference, seconds = greedy(in_ram, inputs, args.new_tokens)
    print(f"{'in RAM':<8} {len(reference) / seconds:6.1f} tok/s (prefill included)")
    del in_ram

    methods = {
        "dense": {"method": "dense"},
        "dip": {"method": "dip", "density": args.density},
        "dip-ca": {"method": "dip", "density": args.density, "cache_aware": 0.2},
    }
    for name, options in methods.items():
        config = flashlm.FlashConfig(**options, memory_budget=args.memory_budget, store=args.store)
        model = AutoModelForCausalLM.from_pretrained(path, quantization_config=config)
        flashlm.stats(model, reset=True)
        tokens, seconds = greedy(model, inputs, args.new_tokens)
        decode = flashlm.stats(model).totals(decode_only=True)
        print(
            f"{name:<8} {len(tokens) / seconds:6.1f} tok/s, "
            f"{decode['bytes_read_per_step'] / 1e6:7.2f} MB read per token, "
            f"MLP density {decode['density']:.0%}, tokens equal: {torch.equal(tokens, reference)}"
        )
        print(f"         {tokenizer.decode(tokens, skip_special_tokens=True)!r}")


if __name__ == "__main__":
    main()
