"""Run by the engine's interpreter (`bench/engine/model.py`): save a trained tokenizer with
`transformers`, as a model repository holds it. Imports nothing from the project.

Saved twice: as trained, then as `AutoTokenizer` loads it beside the directory's config.json.
transformers 5 loads a `qwen2` model's tokenizer as `Qwen2Tokenizer`, which replaces the
tokenizer.json pre-tokenizer with Qwen2's own split (digits one by one, among others), and vLLM
tokenizes with that; the second save writes what the engine really uses, as a published Qwen2
repository's tokenizer.json does.

    .venv-engine/bin/python bench/engine/save.py '{"tokenizer_file": ..., "template": ..., "out": ...}'
"""

import json
import sys

from transformers import AutoTokenizer, PreTrainedTokenizerFast


def main() -> None:
    spec = json.loads(sys.argv[1])
    tok = PreTrainedTokenizerFast(
        tokenizer_file=spec["tokenizer_file"],
        bos_token=spec["bos"],
        eos_token=spec["eos"],
        pad_token=spec["pad"],
    )
    tok.chat_template = spec["template"]
    tok.save_pretrained(spec["out"])
    AutoTokenizer.from_pretrained(spec["out"]).save_pretrained(spec["out"])


if __name__ == "__main__":
    main()
