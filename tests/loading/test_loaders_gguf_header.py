"""The header reader `rjax info`, `rjax list` and pulls use: the same fields and tensors as the full
reader, with arrays of strings stepped over and still bounded by the file."""
from __future__ import annotations

import numpy as np
import pytest

from rjax.loading.loaders.errors import ModelFileError
from rjax.loading.loaders.gguf_header import config_from_reader, open_gguf, quant_name


def test_header_reader_matches_the_full_reader(tiny_path):
    full, header = open_gguf(tiny_path), open_gguf(tiny_path, string_arrays=False)
    assert list(header.fields) == list(full.fields)
    for key, field in full.fields.items():
        if key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"):  # stepped over: the length is kept
            assert int(header.fields[key].parts[-1][0]) == len(field.contents()) > 0  # the last part: the count
            assert header.fields[key].contents() == []
        else:
            assert header.fields[key].contents() == field.contents(), key
    assert [(t.name, t.tensor_type, t.shape.tolist(), t.data_offset) for t in header.tensors] == \
        [(t.name, t.tensor_type, t.shape.tolist(), t.data_offset) for t in full.tensors]
    np.testing.assert_array_equal(header.tensors[0].data, full.tensors[0].data)
    assert config_from_reader(header, tiny_path) == config_from_reader(full, tiny_path)
    assert quant_name(header) == "Q8_0"


def test_a_file_cut_inside_a_string_array_is_named(tiny_path, tmp_path):
    tokens = open_gguf(tiny_path).fields["tokenizer.ggml.tokens"]
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(tiny_path.read_bytes()[: tokens.offset + 200])
    with pytest.raises(ModelFileError, match=r"cut\.gguf is truncated or corrupt: an array of [\d,]+ strings"):
        open_gguf(cut, string_arrays=False)
