"""Damaged model files end in a ModelFileError that names the file, or in a correct load: a
fixed-seed sample of the cases of tests/fuzz/ (the long run is `python -m tests.fuzz --cases
10000`), and one test for each kind of damage users met."""
from __future__ import annotations

import collections
import json
import resource
import shutil
import time

import numpy as np
import pytest

import rjax
import rjax.loading.tokenizer
from rjax.loading.loaders import ModelFileError
from tests.fuzz import gguf_file, hf_directory, run

SAMPLE = 4000  # cases of seed 0 run here: about 20 s on one core


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory):
    return {f.name: f for f in run.make_fixtures(tmp_path_factory.mktemp("fuzz-fixtures"))}


def _load(path):
    return rjax.load(path, progress=False)


def _gguf(fixture, tmp_path, edit=None, patch=None):
    """A copy of a GGUF fixture: its spec edited and written again, or its bytes patched."""
    path = tmp_path / fixture.name
    if edit is not None:
        spec = gguf_file.GGUFSpec(fixture.spec.arch, dict(fixture.spec.kvs), [list(t) for t in fixture.spec.tensors])
        edit(spec)
        return gguf_file.write_gguf(spec, path)
    buf = bytearray(fixture.data)
    if patch is not None:
        patch(buf, fixture.layout)
    path.write_bytes(bytes(buf))
    return path


def _part(layout, kind, tensor=None, key=None):
    """The layout part of one field: of tensor info `tensor`, or of metadata key `key`."""
    if tensor is not None:
        parts = layout.infos[next(i for i, t in enumerate(layout.tensors) if t[0] == tensor)]
    else:
        parts = layout.kvs[layout.keys.index(key)]
    return next(p for p in parts if p.kind == kind)


def test_fixtures_load_and_check(fixtures):
    for fixture in fixtures.values():
        assert run.check_loaded(_load(fixture.path)) is None, fixture.name


def test_fixed_seed_sample(fixtures, tmp_path):
    old = run.limit_memory()  # an allocation sized from an unchecked field fails the case
    try:
        results = [run.run_case(0, i, list(fixtures.values()), tmp_path) for i in range(SAMPLE)]
    finally:
        resource.setrlimit(resource.RLIMIT_AS, old)
    failures = [f"case {i}: {outcome}\n    " + "\n    ".join(steps)
                for i, (outcome, steps, _) in enumerate(results) if outcome.startswith("FAIL")]
    assert not failures, "\n".join(failures[:20])
    outcomes = collections.Counter(outcome for outcome, _, _ in results)
    errors = sum(n for k, n in outcomes.items() if k.startswith(("ModelFileError", "ChatTemplateError")))
    assert any(k.startswith("ChatTemplateError") for k in outcomes), outcomes  # templates are fuzzed too
    # the sample exercises both ends: loads that succeed and many kinds of refusal
    assert outcomes[run.OK] > SAMPLE // 20 and errors > SAMPLE // 2
    assert len(outcomes) > 40, outcomes
    assert max(t for _, _, t in results) < run.TIMEOUT_S


# --- GGUF: the damage users met -------------------------------------------------------------------------------


def test_vocabulary_the_tokenizer_library_refuses(fixtures, tmp_path):
    """A merge naming a token the vocabulary lacks: the tokenizers library's bare Exception
    ('Token ... out of vocabulary') becomes a ModelFileError naming the file and the fields."""
    def edit(spec):
        merges, vtype, sub = spec.kvs["tokenizer.ggml.merges"]
        spec.kvs["tokenizer.ggml.merges"] = (merges + ["zz qq"], vtype, sub)

    path = _gguf(fixtures["llama.gguf"], tmp_path, edit)
    with pytest.raises(ModelFileError, match=rf"{path}: the gpt2 vocabulary \(tokenizer\.ggml\.tokens, merges\) "
                                             r"does not make a tokenizer: .*out of vocabulary"):
        _load(path)


def test_token_that_is_not_utf8(fixtures, tmp_path):
    def edit(spec):
        tokens, vtype, sub = spec.kvs["tokenizer.ggml.tokens"]
        spec.kvs["tokenizer.ggml.tokens"] = (tokens[:100] + [b"ab\xff"] + tokens[101:], vtype, sub)

    path = _gguf(fixtures["gemma3.gguf"], tmp_path, edit)
    with pytest.raises(ModelFileError, match=rf"{path}: tokenizer\.ggml\.tokens entry 100 is not UTF-8"):
        _load(path)


@pytest.mark.parametrize("key, value, message", [
    ("llama.block_count", (1 << 40, "UINT64"),
     r"'llama\.block_count' = 1099511627776 is not an integer in \[1, 4,096\]"),
    ("llama.attention.head_count_kv", (3, "UINT32"), r"head_count 4 is not a multiple of .*head_count_kv 3"),
    ("llama.attention.layer_norm_rms_epsilon", ("tiny", "STRING"), r"= 'tiny' is not a positive number"),
    ("general.architecture", (b"ll\xffama", "STRING"), r"unsupported architecture <unreadable: UnicodeDecodeError"),
    ("tokenizer.ggml.bos_token_id", ("1", "STRING"), r"tokenizer\.ggml\.bos_token_id = '1' is not an integer"),
    ("tokenizer.chat_template", (7, "UINT32"), r"tokenizer\.chat_template = 7 is not a string"),
])
def test_metadata_of_the_wrong_type_or_range(fixtures, tmp_path, key, value, message):
    from gguf import GGUFValueType

    def edit(spec):
        spec.kvs[key] = (value[0], GGUFValueType[value[1]], None)

    path = _gguf(fixtures["llama.gguf"], tmp_path, edit)
    with pytest.raises(ModelFileError, match=rf"{path}: .*{message}"):
        _load(path)


def test_tensor_claiming_petabytes_is_refused_before_anything_is_allocated(fixtures, tmp_path):
    def patch(buf, layout):
        rows = [p for p in layout.infos[0] if p.kind == "dim"][1]  # of token_embd.weight: ne[1]
        gguf_file.put_int(buf, rows, 1 << 40)

    path = _gguf(fixtures["llama.gguf"], tmp_path, patch=patch)
    old = run.limit_memory(1 << 30)
    try:
        with pytest.raises(ModelFileError, match=rf"{path} is truncated or corrupt: tensor 'token_embd\.weight' "
                                                 r"\(Q8_0, shape \[1099511627776, 64\]\) needs bytes .* but the "
                                                 r"file has"):
            _load(path)
    finally:
        resource.setrlimit(resource.RLIMIT_AS, old)


@pytest.mark.parametrize("count", [1 << 40, 40_000])
def test_array_count_past_what_the_file_holds(fixtures, tmp_path, count):
    """gguf's reader parses an array item by item, and reading past the end yields empty views it
    loops on: a damaged count is refused at once (numbers: viewed whole), never a hang."""
    fixture = fixtures["gemma3.gguf"]

    def patch(buf, layout):
        gguf_file.put_int(buf, _part(layout, "count", key="tokenizer.ggml.token_type"), count)

    path = _gguf(fixture, tmp_path, patch=patch)
    start = time.perf_counter()
    with pytest.raises(ModelFileError, match=rf"{path}"):
        _load(path)
    assert time.perf_counter() - start < 2.0


def test_string_arrays_read_as_ggufs_own_reader_reads_them(fixtures):
    """The vocabulary's strings are read in one pass (gguf's reader makes a memmap object of each
    of them, seconds for a 50k vocabulary): the same parts, the same values."""
    from gguf import GGUFReader, GGUFValueType

    from rjax.loading.loaders.gguf import open_gguf

    for fixture in fixtures.values():
        if not fixture.name.endswith(".gguf"):
            continue
        ours, theirs = open_gguf(fixture.path), GGUFReader(fixture.path)
        strings = [k for k, f in theirs.fields.items() if f.types[0] == GGUFValueType.ARRAY
                   and f.types[-1] == GGUFValueType.STRING]
        assert "tokenizer.ggml.tokens" in strings, fixture.name
        for key in strings:
            a, b = ours.fields[key], theirs.fields[key]
            assert (a.types, list(a.data), a.contents()) == (b.types, list(b.data), b.contents()), key
            assert [(p.dtype, p.tobytes()) for p in a.parts] == [(p.dtype, p.tobytes()) for p in b.parts], key


@pytest.mark.parametrize("past_end", [1 << 40, 1])
def test_vocabulary_string_length_past_the_end_of_the_file(fixtures, tmp_path, past_end):
    fixture = fixtures["gemma3.gguf"]
    tokens = fixture.layout.kvs[fixture.layout.keys.index("tokenizer.ggml.tokens")]
    last_len = [p for p in tokens if p.kind == "item_len"][-1]

    def patch(buf, layout):
        gguf_file.put_int(buf, last_len, len(buf) - (last_len.offset + 8) + past_end)

    path = _gguf(fixture, tmp_path, patch=patch)
    with pytest.raises(ModelFileError, match=rf"{path} is truncated or corrupt: string .* past the end of the file"):
        _load(path)


@pytest.mark.parametrize("tensor, what", [
    ("blk.1.attn_k.weight", "values"),         # F32
    ("blk.1.attn_q.weight", "values"),         # BF16
    ("token_embd.weight", "block scales"),     # Q8_0's float16 d
    ("blk.0.ffn_down.weight", "block scales"),  # Q4_K's d and dmin
])
def test_nan_or_inf_weights_are_named(fixtures, tmp_path, tensor, what):
    from gguf import GGMLQuantizationType as Q

    def patch(buf, layout):
        _, qtype, start, _ = next(t for t in layout.tensors if t[0] == tensor)
        value = {Q.F32: np.float32, Q.BF16: None}.get(Q(qtype), np.float16)
        if Q(qtype) == Q.BF16:
            buf[start + 10:start + 12] = (0x7F80).to_bytes(2, "little")  # +inf
        elif Q(qtype) == Q.Q4_K:
            buf[start + 144 + 2:start + 144 + 4] = np.array(np.nan, np.float16).tobytes()  # block 1's dmin
        else:
            buf[start:start + np.dtype(value).itemsize] = np.array(np.nan, value).tobytes()

    path = _gguf(fixtures["llama.gguf"], tmp_path, patch=patch)
    with pytest.raises(ModelFileError, match=rf"{path}: tensor '{tensor}' has 1 NaN or Inf {what} of "):
        _load(path)


@pytest.mark.parametrize("name, message", [
    ("blk.7.attn_q.weight", r"tensor 'blk\.7\.attn_q\.weight' names block '7', but the file has 2 blocks"),
    ("blk.x.attn_q.weight", r"tensor 'blk\.x\.attn_q\.weight' names block 'x'"),
])
def test_tensor_of_a_block_the_file_does_not_have(fixtures, tmp_path, name, message):
    def edit(spec):
        i = next(i for i, t in enumerate(spec.tensors) if t[0] == "blk.0.attn_q.weight")
        spec.tensors[i][0] = name

    path = _gguf(fixtures["llama.gguf"], tmp_path, edit)
    with pytest.raises(ModelFileError, match=rf"{path}: {message}"):
        _load(path)


def test_tensor_shape_that_disagrees_with_the_metadata(fixtures, tmp_path):
    def edit(spec):
        i = next(i for i, t in enumerate(spec.tensors) if t[0] == "blk.0.attn_output.weight")
        spec.tensors[i][1] = (32, 128)  # the same bytes, another shape

    path = _gguf(fixtures["llama.gguf"], tmp_path, edit)
    with pytest.raises(ModelFileError, match=rf"{path}: tensor 'blk\.0\.attn_output\.weight' has shape \[32, 128\], "
                                             r"but the metadata implies \[64, 64\]"):
        _load(path)


def test_file_that_is_not_a_gguf(tmp_path):
    path = tmp_path / "notes.gguf"
    path.write_text("not a model")
    with pytest.raises(ModelFileError, match=rf"{path} is not a GGUF file"):
        _load(path)


# --- Hugging Face directories ---------------------------------------------------------------------------------


def _hf(fixture, tmp_path):
    path = tmp_path / fixture.name
    shutil.copytree(fixture.path, path)
    return path


@pytest.mark.parametrize("changes, message", [
    (dict(num_hidden_layers=10 ** 12), r"config key 'num_hidden_layers' = 1000000000000 is more than 4,096"),
    (dict(hidden_size=float("nan")), r"config key 'hidden_size' = nan is not an integer >= 1"),
    (dict(rope_scaling={"rope_type": "llama3", "factor": "x", "low_freq_factor": 1, "high_freq_factor": 4}),
     r"config key 'rope factor' = 'x' is not a positive number"),
    (dict(rope_scaling=[1, 2]), r"config key 'rope_scaling' = \[1, 2\] is not an object"),
    (dict(tie_word_embeddings="no"), r"config key 'tie_word_embeddings' = 'no' is not true or false"),
    (dict(hidden_act=["silu"]), r"config key 'hidden_act' = \['silu'\] is not a string"),
])
def test_hf_config_fields_of_the_wrong_type_or_range(fixtures, tmp_path, changes, message):
    path = _hf(fixtures["llama-hf-sharded"], tmp_path)
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelFileError, match=rf"{path / 'config.json'}: {message}"):
        _load(path)


def test_hf_nan_weight_is_named(fixtures, tmp_path):
    path = _hf(fixtures["qwen2-hf"], tmp_path)
    file = path / "model.safetensors"
    header, body = hf_directory.split_safetensors(file.read_bytes())
    start, _ = header["model.layers.1.self_attn.k_proj.weight"]["data_offsets"]  # float16
    body = body[:start + 6] + np.array(np.inf, np.float16).tobytes() + body[start + 8:]
    file.write_bytes(hf_directory.join_safetensors(header, body))
    with pytest.raises(ModelFileError, match=rf"{file}: tensor 'model\.layers\.1\.self_attn\.k_proj\.weight' has 1 "
                                             r"NaN or Inf values"):
        _load(path)


def test_hf_index_naming_a_file_outside_the_directory(fixtures, tmp_path):
    path = _hf(fixtures["llama-hf-sharded"], tmp_path)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.norm.weight"] = "/etc/hostname"
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ModelFileError, match=r"weight_map names '/etc/hostname', not a file name in the directory"):
        _load(path)


def test_hf_tokenizer_that_does_not_parse(fixtures, tmp_path):
    path = _hf(fixtures["qwen2-hf"], tmp_path)
    (path / "tokenizer.json").write_text('{"model": ')
    with pytest.raises(ModelFileError, match=rf"{path / 'tokenizer.json'}: not a tokenizer the tokenizers library"):
        _load(path)


def test_tokenizer_larger_than_the_embedding(fixtures, tmp_path):
    path = _hf(fixtures["qwen2-hf"], tmp_path)
    config = json.loads((path / "config.json").read_text())
    header, body = hf_directory.split_safetensors((path / "model.safetensors").read_bytes())
    assert config["vocab_size"] == 272 and header["model.embed_tokens.weight"]["shape"] == [272, 64]
    tokenizer = json.loads((path / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    vocab.update({f"extra{i}": len(vocab) + 3 + i for i in range(10)})  # ids past the 3 added tokens
    (path / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(ModelFileError, match=rf"{path}: the tokenizer has 279 tokens, but the embedding has 272 rows"):
        _load(path)


@pytest.mark.parametrize("file", ["config.json", "tokenizer_config.json", "generation_config.json",
                                  "model.safetensors.index.json"])
def test_hf_json_nested_too_deeply(fixtures, tmp_path, file):
    """JSON nested past any real file's depth (100,000 levels would make the parser recurse out of
    stack) is refused naming the file."""
    path = _hf(fixtures["llama-hf-sharded"], tmp_path)
    for depth in (100_000, 65):
        value = json.loads((path / file).read_text())
        (path / file).write_text(json.dumps(value)[:-1] + ', "x": ' + "[" * depth + "]" * depth + "}")
        with pytest.raises(ModelFileError, match=rf"{path / file}: JSON nested deeper than 64 levels"):
            _load(path)
        shutil.copy(fixtures["llama-hf-sharded"].path / file, path / file)


@pytest.mark.parametrize("changes, message", [
    (dict(rope_theta=0), r"config key 'rope_theta' = 0 is not a positive number"),
    (dict(rope_scaling={"rope_type": "default", "rope_theta": 0}), r"config key 'rope_theta' = 0 is not a positive"),
    (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                        "original_max_position_embeddings": 0}),
     r"rope original_max_position_embeddings = 0 is not an integer"),
    (dict(rope_scaling=0), r"config key 'rope_scaling' = 0 is not an object"),
])
def test_hf_config_values_are_never_silently_replaced(fixtures, tmp_path, changes, message):
    """A zero is not a missing key: it is refused, not replaced by the default."""
    path = _hf(fixtures["llama-hf-sharded"], tmp_path)
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelFileError, match=rf"{path / 'config.json'}: {message}"):
        _load(path)


def test_chat_template_that_does_not_compile_is_refused_at_load(fixtures, tmp_path):
    def edit(spec):
        spec.kvs["tokenizer.chat_template"] = ("{% for m in messages %}{{ m['content'] }", *spec.kvs[
            "tokenizer.chat_template"][1:])

    path = _gguf(fixtures["llama.gguf"], tmp_path, edit)
    with pytest.raises(ModelFileError, match=rf"{path} \(tokenizer\.chat_template\): the chat template does not "
                                             r"compile: line 1: unexpected '}'"):
        rjax.loading.tokenizer.Tokenizer.from_gguf(path)
    hf = _hf(fixtures["qwen2-hf"], tmp_path)
    (hf / "chat_template.jinja").write_text("{% if %}")
    with pytest.raises(ModelFileError, match=rf"{hf / 'chat_template.jinja'}: the chat template does not compile"):
        rjax.loading.tokenizer.Tokenizer.from_hf_dir(hf)
