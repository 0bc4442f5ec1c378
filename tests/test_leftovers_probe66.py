"""Stop 66, known defects left by earlier stops: each pinned here (docs/traceability.md "Found
at stop 66 (leftovers)"). Real executor on the bundled emulator; every wait bounded."""

from __future__ import annotations

import json

import pytest


# ---- 1. a tokenizer_config.json saved with a byte order mark ---------------------------------
def test_a_tokenizer_config_saved_with_a_byte_order_mark_is_read(tmp_path):
    """``calexec serve --tokenizer DIR`` whose ``tokenizer_config.json`` an editor saved with a
    UTF-8 byte order mark (Notepad's, after touching up the chat template) was refused at
    start, ``'DIR/tokenizer_config.json' is not readable JSON: Unexpected UTF-8 BOM (decode
    using utf-8-sig)``, where every other file calexec reads drops the mark (stop 65). The
    mark is dropped: the template and the special tokens are read as without it. So is one
    of ``tokenizer.json`` (the ``tokenizers`` library refused it, ``cannot load ... as a
    tokenizer.json: expected value at line 1 column 1``)."""
    tokenizers = pytest.importorskip("tokenizers")
    pytest.importorskip("jinja2")
    from tokenizers import models, pre_tokenizers

    from calexec.drivers.serving import hf_tokenizer
    tok = tokenizers.Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 5, "<eos>": 6},
                                                unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<eos>"])
    tok.save(str(tmp_path / "tokenizer.json"))
    template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    config = json.dumps({"chat_template": template, "eos_token": "<eos>"})
    (tmp_path / "tokenizer_config.json").write_bytes(b"\xef\xbb\xbf" + config.encode())
    loaded = hf_tokenizer.load(str(tmp_path))
    assert (loaded.chat_template, loaded.eos_token, loaded.eos_token_id) == (template, "<eos>", 6)
    tokenizer_json = tmp_path / "tokenizer.json"
    tokenizer_json.write_bytes(b"\xef\xbb\xbf" + tokenizer_json.read_bytes())
    loaded = hf_tokenizer.load(str(tmp_path))
    assert (loaded.encode("hello <eos>"), loaded.eos_token_id) == ([5, 6], 6)
    # a mark anywhere else is no encoding's: still refused, naming the file
    (tmp_path / "tokenizer_config.json").write_bytes(b"\xef\xbb\xbf\xef\xbb\xbf" + config.encode())
    with pytest.raises(hf_tokenizer.TokenizerLoadError, match="is not readable JSON"):
        hf_tokenizer.load(str(tmp_path))

