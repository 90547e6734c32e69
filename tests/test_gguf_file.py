"""kvserve's GGUF reader against gguf's own GGUFReader: every metadata value and every tensor's
mapped data, on the shipped files and on a file gguf's writer makes with every value type."""

import numpy as np
import pytest

from kvserve.model.gguf_file import GGUFFile, GGUFFormatError


def assert_reads_alike(path) -> None:
    import gguf

    ref, ours = gguf.GGUFReader(path), GGUFFile(path)
    names = [k for k in ref.fields if not k.startswith("GGUF.")]  # the header, which ours keeps apart
    assert names == list(ours.fields)
    for name in names:
        assert ours.fields[name].contents() == ref.fields[name].contents(), name
        assert len(ours.fields[name].data) == len(ref.fields[name].data), name
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for a, b in zip(ours.tensors, ref.tensors):
        assert (a.tensor_type, list(a.shape), a.n_elements, a.n_bytes, a.data_offset) == \
            (b.tensor_type, list(b.shape), b.n_elements, b.n_bytes, b.data_offset), a.name
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape, a.name
        assert np.array_equal(a.data.view(np.uint8), b.data.view(np.uint8)), a.name


def test_the_bundled_model_reads_as_gguf_reads_it(bundled_model_path):
    assert_reads_alike(bundled_model_path)


def test_every_value_type_and_tensor_type(tmp_path):
    import gguf

    path = tmp_path / "all.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint8("t.u8", 200)
    writer.add_int8("t.i8", -100)
    writer.add_uint16("t.u16", 60000)
    writer.add_int16("t.i16", -30000)
    writer.add_uint32("t.u32", 4_000_000_000)
    writer.add_int32("t.i32", -2_000_000_000)
    writer.add_float32("t.f32", 0.1)
    writer.add_uint64("t.u64", 2**63 + 5)
    writer.add_int64("t.i64", -(2**62))
    writer.add_float64("t.f64", 0.1)
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "héllo ✓")
    writer.add_array("t.strs", ["a", "", "ü" * 7])
    writer.add_array("t.ints", [1, -2, 3])
    writer.add_array("t.floats", [0.5, -1.25])
    writer.add_array("t.empty", [])
    rng = np.random.default_rng(0)
    writer.add_tensor("f32", rng.standard_normal((3, 8)).astype(np.float32))
    writer.add_tensor("f16", rng.standard_normal((2, 4)).astype(np.float16))
    writer.add_tensor("i32", np.arange(6, dtype=np.int32).reshape(2, 3))
    q8 = gguf.quants.quantize(rng.standard_normal((4, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("q8", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert_reads_alike(path)
    ours = GGUFFile(path)
    assert ours.fields["t.strs"].contents() == ["a", "", "ü" * 7]
    assert ours.fields["t.u64"].contents() == 2**63 + 5
    q8_read = next(t for t in ours.tensors if t.name == "q8")
    np.testing.assert_array_equal(gguf.quants.dequantize(q8_read.data, q8_read.tensor_type),
                                  gguf.quants.dequantize(q8, gguf.GGMLQuantizationType.Q8_0))


@pytest.mark.parametrize("content, says", [
    (b"", "not a GGUF"), (b"GGML" + bytes(20), "no GGUF magic"),
    (b"GGUF" + (7).to_bytes(4, "little") + bytes(16), "version 7"),
    (b"GGUF" + (3).to_bytes(4, "little") + (0).to_bytes(8, "little") + (5).to_bytes(8, "little"), "truncated"),
])
def test_a_bad_file_is_named_with_the_reason(tmp_path, content, says):
    path = tmp_path / "bad.gguf"
    path.write_bytes(content)
    with pytest.raises(GGUFFormatError, match=says):
        GGUFFile(path)


@pytest.mark.parametrize("keep, says", [(0.5, "past the end of the file"), (200_000, "truncated inside a string array")])
def test_a_truncated_file_is_refused(bundled_model_path, tmp_path, keep, says):
    """Cut in its tensor data, or in its vocabulary (the metadata's string arrays)."""
    data = open(bundled_model_path, "rb").read()
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[: int(len(data) * keep) if keep < 1 else keep])
    with pytest.raises(GGUFFormatError, match=says):
        GGUFFile(path)
