"""Manifest loading (§4.1) and resolution against the runtime's models (§10.2, S08, S09, FI01)."""

import attrs
import pytest

from calexec.contracts.errors import Category
from calexec.contracts.manifest import ManifestError, default_manifest_path, load_manifest
from calexec.contracts.runtime_view import RuntimeModelInfo, RuntimeTensorInfo
from calexec.contracts.status import Phase
from calexec.contracts.types import ModelGeneration, TaskKind

SHA = "0123456789abcdef" * 4
DEFAULT_TEXT = default_manifest_path().read_text()
V = 151936


def rt(name, shape, dtype, itemsize, sliceable):
    size = itemsize
    for d in shape:
        size *= d
    return RuntimeTensorInfo(name, shape, dtype, size, sliceable)


def emulator_models():
    """What the bundled emulator's calbin reports, written out from the brief (independent oracle)."""
    csrs = ("cur_seq_len", "total_seq_len")
    meta16 = {"logits_tile_d0": 16, "max_seq": 40960, "max_batch": 1}
    ids = rt("input_ids", (1, 40960), "S32", 4, True)
    pos = rt("positions", (1, 40960), "S32", 4, True)
    tiled = rt("logits", (1, 16, V), "BF16", 2, False)
    decode_in = (rt("input_ids", (1, 1), "S32", 4, False), rt("positions", (1, 1), "S32", 4, False))
    decode_out = (rt("logits", (1, 1, V), "BF16", 2, False),)
    meta1 = {"logits_tile_d0": 1, "max_seq": 40960, "max_batch": 1}
    return [
        RuntimeModelInfo("qwen3_prefill_ids_s40960_b1", (ids, pos), (tiled,), csrs, meta16),
        RuntimeModelInfo("qwen3_prefill_embeds_s40960_b1",
                         (rt("inputs_embeds", (1, 40960, 64), "BF16", 2, True), pos), (tiled,), csrs, meta16),
        RuntimeModelInfo("qwen3_decode_s40960_b1", decode_in, decode_out, csrs, meta1),
        # Decoy: contains the decode name as a prefix and comes last, which is what an old
        # "substring, last match wins" lookup would have picked (S08).
        RuntimeModelInfo("qwen3_decode_s40960_b1_draft", decode_in, decode_out, csrs, meta1),
    ]


def write(tmp_path, text, name="m.toml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def replace_once(text, old, new, nth=0):
    parts = text.split(old)
    assert len(parts) > nth + 1, f"{old!r} occurs fewer than {nth + 1} times"
    return old.join(parts[: nth + 1]) + new + old.join(parts[nth + 1:])


def edit_tensor(models, model, tensor, **changes):
    out = []
    for m in models:
        if m.name == model:
            fix = lambda ts: tuple(attrs.evolve(t, **changes) if t.name == tensor else t for t in ts)  # noqa: E731
            m = attrs.evolve(m, inputs=fix(m.inputs), outputs=fix(m.outputs))
        out.append(m)
    return out


@pytest.fixture(scope="module")
def manifest():
    return load_manifest(default_manifest_path())


# ---- loading -------------------------------------------------------------------------------

def test_default_manifest_describes_the_emulator_calbin(manifest):
    assert default_manifest_path().name == "qwen3_synthetic.toml"
    assert (manifest.calrt_version, manifest.vocab_size, manifest.hidden_size) == ("0.7.6", V, 64)
    assert manifest.calbin_sha256 is None
    subs = manifest.submodels
    assert set(subs) == {TaskKind.PREFILL_IDS, TaskKind.PREFILL_EMBEDS, TaskKind.DECODE}
    ids = subs[TaskKind.PREFILL_IDS]
    assert ids.exact_name == "qwen3_prefill_ids_s40960_b1"
    assert (ids.token_or_embed.name, ids.token_or_embed.shape, ids.token_or_embed.sliceable) == (
        "input_ids", (1, 40960), True)
    assert (ids.logits.shape, ids.logits_tile_d0, ids.max_seq, ids.max_batch) == ((1, 16, V), 16, 40960, 1)
    assert subs[TaskKind.PREFILL_EMBEDS].token_or_embed.shape == (1, 40960, 64)
    dec = subs[TaskKind.DECODE]
    assert (dec.token_or_embed.shape, dec.token_or_embed.sliceable, dec.logits_tile_d0) == ((1, 1), False, 1)
    assert {(s.csr_cur_seq, s.csr_total_seq) for s in subs.values()} == {("cur_seq_len", "total_seq_len")}


MALFORMED = [
    ("unknown top key", ('vocab_size = ', 'colour = "red"\nvocab_size = '), "colour"),
    ("unknown submodel key", ('kind = "prefill_ids"\n', 'kind = "prefill_ids"\ntile = 3\n'), "submodel[0].tile"),
    ("unknown tensor key", ("sliceable = true }", "sliceable = true, offset = 0 }"),
     "submodel[0].token_or_embed.offset"),
    ("missing key", ("vocab_size = 151936\n", ""), "vocab_size"),
    ("missing tensor key", (', sliceable = false }', ' }'), "submodel[0].logits.sliceable"),
    ("string for int", ("max_seq = 40960", 'max_seq = "40960"'), "submodel[0].max_seq"),
    ("bool for int", ("max_batch = 1", "max_batch = true"), "submodel[0].max_batch"),
    ("int for bool", ("sliceable = true", "sliceable = 1"), "submodel[0].token_or_embed.sliceable"),
    ("unknown dtype", ('dtype = "S32"', 'dtype = "S31"'), "submodel[0].token_or_embed.dtype"),
    ("byte_size inconsistent", ("byte_size = 163840", "byte_size = 163841"), "submodel[0].token_or_embed.byte_size"),
    ("zero dimension", ("shape = [1, 40960]", "shape = [0, 40960]"), "submodel[0].token_or_embed.shape"),
    ("unknown kind", ('kind = "decode"', 'kind = "decoder"'), "submodel[2].kind"),
    ("duplicate kind", ('kind = "prefill_embeds"', 'kind = "prefill_ids"'), "submodel[1].kind"),
    ("duplicate exact name", ('"qwen3_prefill_embeds_s40960_b1"', '"qwen3_prefill_ids_s40960_b1"'),
     "submodel[1].exact_name"),
    ("tile rows differ from logits", ("logits_tile_d0 = 1\n", "logits_tile_d0 = 2\n"), "submodel[2].logits_tile_d0"),
    ("vocab differs from logits", ("vocab_size = 151936", "vocab_size = 151935"), "submodel[0].logits.shape"),
    ("hidden differs from embeds", ("hidden_size = 64", "hidden_size = 65"), "submodel[1].token_or_embed.shape"),
    ("bad sha pin", ("# calbin_sha256 = ", 'calbin_sha256 = "xyz" # '), "calbin_sha256"),
    ("not toml", ("name = ", "name = = "), "<toml>"),
]


@pytest.mark.parametrize(("edit", "key"), [m[1:] for m in MALFORMED], ids=[m[0] for m in MALFORMED])
def test_malformed_manifest_names_file_and_key(tmp_path, edit, key):
    path = write(tmp_path, replace_once(DEFAULT_TEXT, *edit))
    with pytest.raises(ManifestError) as info:
        load_manifest(path)
    assert info.value.key == key
    assert str(info.value).startswith(f"{path}: {key}")


def test_malformed_value_is_named(tmp_path):
    path = write(tmp_path, replace_once(DEFAULT_TEXT, "max_seq = 40960", "max_seq = 0"))
    with pytest.raises(ManifestError, match=r"submodel\[0\]\.max_seq=0") as info:
        load_manifest(path)
    assert info.value.value == 0


# ---- resolution ----------------------------------------------------------------------------

def test_exact_match_resolves_and_ignores_the_decoy(manifest):
    models = emulator_models()
    gen = manifest.resolve(models, generation_id=5, calbin_sha256=SHA)
    assert isinstance(gen, ModelGeneration)
    assert (gen.generation_id, gen.calbin_sha256, gen.calrt_version, gen.vocab_size) == (5, SHA, "0.7.6", V)
    assert gen.submodel(TaskKind.DECODE).exact_name == "qwen3_decode_s40960_b1"
    assert manifest.ignored_models == ("qwen3_decode_s40960_b1_draft",)
    assert manifest.unlisted(models) == ()


# ---- §10.2: a runtime model the manifest does not list refuses Ready -------------------------

def test_unlisted_runtime_model_refuses_the_generation(manifest):
    models = emulator_models() + [attrs.evolve(emulator_models()[2], name="qwen3_decode_s40960_b1_v2")]
    result = manifest.resolve(models, 1, SHA)
    assert_refused(result, "model_unlisted", "'qwen3_decode_s40960_b1_v2'", "ignored_models")
    assert "qwen3_decode_s40960_b1_draft" not in result.message  # listed as ignored


def test_the_decoy_refuses_ready_unless_the_manifest_lists_it(tmp_path):
    text = "\n".join(line for line in DEFAULT_TEXT.splitlines() if not line.startswith("ignored_models"))
    bare = load_manifest(write(tmp_path, text))
    assert bare.ignored_models == ()
    result = bare.resolve(emulator_models(), 1, SHA)
    assert_refused(result, "model_unlisted", "'qwen3_decode_s40960_b1_draft'")


def test_missing_is_reported_before_unlisted(tmp_path):
    """FI01: the renamed manifest entry is named, not just the runtime model it left over."""
    text = replace_once(DEFAULT_TEXT, '"qwen3_decode_s40960_b1"', '"qwen3_decode_s40960_b2"')
    result = load_manifest(write(tmp_path, text)).resolve(emulator_models(), 1, SHA)
    assert_refused(result, "model_missing", "'qwen3_decode_s40960_b2'")


@pytest.mark.parametrize(("value", "key", "problem"), [
    ('["qwen3_decode_s40960_b1"]', "ignored_models[0]", "a model is served or ignored"),
    ('["a", "a"]', "ignored_models[1]", "listed twice"),
    ('[1]', "ignored_models[0]", "non-empty string"),
    ('"qwen3_decode_s40960_b1_draft"', "ignored_models", "must be of TOML type array"),
])
def test_malformed_ignored_models(tmp_path, value, key, problem):
    text = replace_once(DEFAULT_TEXT, 'ignored_models = ["qwen3_decode_s40960_b1_draft"]',
                        f"ignored_models = {value}")
    with pytest.raises(ManifestError) as info:
        load_manifest(write(tmp_path, text))
    assert info.value.key == key and problem in str(info.value), str(info.value)


def assert_refused(result, reason, *names):
    assert not isinstance(result, ModelGeneration), "resolve accepted a mismatching runtime"
    assert (result.category, result.phase, result.code) == (Category.ARTIFACT, Phase.CONFIGURE, f"manifest.{reason}")
    for name in names:
        assert name in result.message, (name, result.message)


def test_fi01_one_character_changed_in_the_manifest_fails(tmp_path):
    text = replace_once(DEFAULT_TEXT, '"qwen3_decode_s40960_b1"', '"qwen3_decode_s40960_b2"')
    result = load_manifest(write(tmp_path, text)).resolve(emulator_models(), 1, SHA)
    assert_refused(result, "model_missing", "'qwen3_decode_s40960_b2'")


def test_one_character_changed_in_the_runtime_fails(manifest):
    models = emulator_models()
    models[0] = attrs.evolve(models[0], name="qwen3_prefill_ids_s40960_b2")
    assert_refused(manifest.resolve(models, 1, SHA), "model_missing", "'qwen3_prefill_ids_s40960_b1'")


def test_missing_model(manifest):
    models = [m for m in emulator_models() if m.name != "qwen3_prefill_embeds_s40960_b1"]
    assert_refused(manifest.resolve(models, 1, SHA), "model_missing", "qwen3_prefill_embeds_s40960_b1")


def test_decoy_prefix_model_is_never_chosen(manifest):
    models = [m for m in emulator_models() if m.name != "qwen3_decode_s40960_b1"]
    assert_refused(manifest.resolve(models, 1, SHA), "model_missing", "'qwen3_decode_s40960_b1'")


def test_duplicate_runtime_name(manifest):
    models = emulator_models()
    models.append(models[2])
    assert_refused(manifest.resolve(models, 1, SHA), "model_duplicate", "qwen3_decode_s40960_b1", "2 times")


@pytest.mark.parametrize(
    ("model", "tensor", "change", "field"),
    [
        ("qwen3_decode_s40960_b1", "input_ids", {"dtype": "F32"}, "dtype"),
        ("qwen3_prefill_ids_s40960_b1", "positions", {"shape": (40960,), "byte_size": 163840}, "rank"),
        ("qwen3_prefill_ids_s40960_b1", "input_ids", {"shape": (1, 40959), "byte_size": 163836}, "shape"),
        ("qwen3_prefill_embeds_s40960_b1", "inputs_embeds", {"byte_size": 5242879}, "byte_size"),
        ("qwen3_prefill_ids_s40960_b1", "positions", {"sliceable": False}, "sliceable"),
        ("qwen3_decode_s40960_b1", "logits", {"shape": (1, 1, V - 1), "byte_size": 2 * (V - 1)}, "shape"),
    ],
)
def test_tensor_mismatch_names_model_tensor_and_field(manifest, model, tensor, change, field):
    result = manifest.resolve(edit_tensor(emulator_models(), model, tensor, **change), 1, SHA)
    assert_refused(result, "tensor_mismatch", repr(model), repr(tensor), f"{field} manifest=")


def test_tensor_missing(manifest):
    result = manifest.resolve(edit_tensor(emulator_models(), "qwen3_decode_s40960_b1", "positions", name="pos"), 1, SHA)
    assert_refused(result, "tensor_missing", "'positions'", "qwen3_decode_s40960_b1")


def test_csr_missing(manifest):
    models = emulator_models()
    models[1] = attrs.evolve(models[1], csr_names=("cur_seq_len", "total_seq"))
    assert_refused(manifest.resolve(models, 1, SHA), "csr_missing", "'total_seq_len'", "qwen3_prefill_embeds_s40960_b1")


@pytest.mark.parametrize(("key", "value"), [("logits_tile_d0", 8), ("max_seq", 32768), ("max_batch", 2)])
def test_graph_metadata_mismatch_refuses(manifest, key, value):
    models = emulator_models()
    models[0] = attrs.evolve(models[0], meta={**models[0].meta, key: value})
    assert_refused(manifest.resolve(models, 1, SHA), "meta_mismatch", key, f"graph metadata={value}")


def test_graph_metadata_absent_refuses(manifest):
    models = emulator_models()
    models[2] = attrs.evolve(models[2], meta={"max_seq": 40960, "max_batch": 1})
    assert_refused(manifest.resolve(models, 1, SHA), "meta_mismatch", "logits_tile_d0", "graph metadata=None")


def test_sha256_pin(tmp_path):
    pinned = load_manifest(write(tmp_path, replace_once(DEFAULT_TEXT, "# calbin_sha256 = ",
                                                        f'calbin_sha256 = "{SHA}" # ')))
    assert pinned.calbin_sha256 == SHA
    assert isinstance(pinned.resolve(emulator_models(), 1, SHA.upper()), ModelGeneration)
    other = "f" * 64
    assert_refused(pinned.resolve(emulator_models(), 1, other), "sha256_mismatch", other, SHA)


def test_malformed_sha_refuses(manifest):
    assert_refused(manifest.resolve(emulator_models(), 1, "abc"), "bad_sha256", "'abc'")
