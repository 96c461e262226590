"""Wanda-prune a checkpoint, then run the pruned model with Endor's compressed offloading.

`flashlm.workflows.prune.prune_checkpoint` scores every decoder weight by |W|·‖X‖ on a corpus's
calibration split and zeroes the lowest half of each row (or an N:M pattern), saving a complete
checkpoint. Loading it with `FlashConfig(method="endor", memory_budget=...)` keeps every decoder linear
in Endor's bitmap format: layers in order go to memory (compressed) while the budget lasts, the rest to
an SSD store read once per layer per token, each decompressed just before use.

    python examples/prune_and_endor.py                          # SmolLM2, 50% sparsity, 25% budget
    python examples/prune_and_endor.py --out /tmp/smollm2-wanda50 --n-m 2:4 --memory-budget 40%
"""

import tempfile
from argparse import ArgumentParser, RawDescriptionHelpFormatter
from pathlib import Path

from transformers import AutoModelForCausalLM, AutoTokenizer

import flashlm
from flashlm.data.models import model_path
from flashlm.workflows.prune import prune_checkpoint, read_pruning_record


def main() -> None:
    parser = ArgumentParser(description=__doc__, formatter_class=RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a bundled model's name or a checkpoint directory (default: SmolLM2)")
    parser.add_argument("--store", help="Endor store directory (default: beside --out)")
    parser.add_argument("--out", help="pruned checkpoint directory, reused if it exists (default: temporary)")
    parser.add_argument("--sparsity", type=float, default=0.5, help="fraction of each row's weights pruned")
    parser.add_argument("--n-m", help="N:M pattern instead of --sparsity, such as 2:4")
    parser.add_argument("--windows", type=int, default=16, help="calibration windows")
    parser.add_argument("--context-length", type=int, default=512, help="tokens per calibration window")
    parser.add_argument(
        "--memory-budget", default="25%", help="'25%%' of the dense decoder linears, or '32MB'"
    )
    parser.add_argument("--prompt", default="The capital of France is")
    parser.add_argument("--new-tokens", type=int, default=32)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="flashlm-example-") as work:
        out = Path(args.out) if args.out else Path(work) / "pruned"
        store = args.store or str(out.parent / f"{out.name}.endor")
        if (record := read_pruning_record(out)) is not None:  # pruned by an earlier run: store stays valid
            print(f"reusing {out}, pruned to {record['achieved_sparsity']:.1%} sparsity")
        else:
            report = prune_checkpoint(
                model_path(args.model),
                out,
                sparsity=None if args.n_m else args.sparsity,
                n_m=tuple(int(n) for n in args.n_m.split(":")) if args.n_m else None,
                num_windows=args.windows,
                context_length=args.context_length,
            )
            print(f"pruned {len(report.linears)} linears to {report.achieved_sparsity:.1%} sparsity: {out}")

        tokenizer = AutoTokenizer.from_pretrained(out)
        config = flashlm.FlashConfig(method="endor", memory_budget=args.memory_budget, store=store)
        model = AutoModelForCausalLM.from_pretrained(out, quantization_config=config)
        inputs = tokenizer(args.prompt, return_tensors="pt")
        flashlm.stats(model, reset=True)
        generated = model.generate(**inputs, max_new_tokens=args.new_tokens, do_sample=False)
        print(tokenizer.decode(generated[0], skip_special_tokens=True))

        stats = flashlm.stats(model)
        decode = stats.totals(decode_only=True)
        in_memory, on_disk = stats.placement.count("cpu"), stats.placement.count("disk")
        print(
            f"endor: layers {in_memory} in memory, {on_disk} on disk (compressed), "
            f"{decode['bytes_read_per_step'] / 1e6:.2f} MB read per token, "
            f"decompression by {stats.decompression}"
        )
        print(stats.summary())


if __name__ == "__main__":
    main()
