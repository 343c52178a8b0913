"""Greedy agreement of two spec-run --output_json files over the same prompts (issue 6,
item 6: bf16 against f32). Per prompt: identical or not, and the first position where the
output ids differ. Greedy decoding diverges for good after its first different token, so the
mean matching prefix (as a share of the reference's length) is the figure reported.
Usage: python3 agreement.py REFERENCE.json OTHER.json"""
import json
import sys

ref = [o["output_ids"] for o in json.load(open(sys.argv[1]))["outputs"]]
other = [o["output_ids"] for o in json.load(open(sys.argv[2]))["outputs"]]
if len(ref) != len(other):
    sys.exit(f"{sys.argv[1]} has {len(ref)} outputs, {sys.argv[2]} has {len(other)}")
identical, prefix_share = 0, []
for i, (a, b) in enumerate(zip(ref, other)):
    n = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    identical += a == b
    prefix_share.append(n / max(len(a), 1))
    print(f"prompt {i:2d}: {'identical' if a == b else f'first difference at token {n} of {len(a)}'}")
print(
    f"{identical}/{len(ref)} identical; mean matching prefix {100 * sum(prefix_share) / len(ref):.1f}% "
    f"of the reference's tokens"
)
