"""The benchmark pages: a section lands on the page whose groups claim its key, each group keeps
its newest few, and nothing unclaimed grows a page."""

from __future__ import annotations

import dataclasses
import itertools
from datetime import datetime, timedelta

import pytest
from bench_scripts import script

benchdoc = script("benchdoc")


@pytest.fixture
def pages(tmp_path, monkeypatch):
    moved = tuple(dataclasses.replace(p, path=tmp_path / p.path.name) for p in benchdoc.PAGES)
    monkeypatch.setattr(benchdoc, "PAGES", moved)
    monkeypatch.setattr(benchdoc, "SCRATCH", tmp_path / "scratch")
    monkeypatch.setattr(benchdoc, "datetime", Clock)  # a second between writes
    return moved


class Clock(datetime):
    _ticks = itertools.count()

    @classmethod
    def now(cls, tz=None):
        return datetime(2026, 1, 1, tzinfo=tz) + timedelta(seconds=next(cls._ticks))


def keys(path):
    return [s.key for s in benchdoc.parse_sections(path.read_text())]


def test_a_section_goes_to_the_page_that_claims_it(pages):
    headline, serving, features, gpu = pages
    benchdoc.write_section(headline.path, "bench_cpu-smollm2-as-source-int8-intel-avx512", "A")
    benchdoc.write_section(headline.path, "bench_suffix-qwen-intel-avx512", "B")
    benchdoc.write_section(features.path, "bench_serving-qwen-intel-avx512", "C")
    benchdoc.write_section(headline.path, "bench_serving-smollm2-amd-avx2", "E")
    assert keys(headline.path) == ["bench_cpu-smollm2-as-source-int8-intel-avx512"]
    assert keys(features.path) == ["bench_suffix-qwen-intel-avx512"]
    assert keys(serving.path) == [
        "bench_serving-smollm2-amd-avx2",
        "bench_serving-qwen-intel-avx512",
    ]  # grouped by model, SmolLM2 first, whichever was written first
    benchdoc.write_section(headline.path, "gpu_check", "D")
    assert keys(gpu.path) == ["gpu_check"]
    assert "gpu_check" not in keys(headline.path)
    assert headline.path.read_text().startswith("# Benchmarks\n")
    for linked in ("benchmarks-serving.md", "benchmarks-features.md"):
        assert linked in headline.path.read_text()


def test_a_group_keeps_its_newest_sections_and_rewrites_its_own(pages):
    headline, *_ = pages
    for cpu in ("amd-avx2", "amd-avx512", "intel-avx512"):
        benchdoc.write_section(headline.path, f"bench_cpu-smollm2-as-source-int8-{cpu}", cpu)
    benchdoc.write_section(headline.path, "bench_cpu-smollm2-as-source-int8-amd-avx512", "new")
    sections = benchdoc.parse_sections(headline.path.read_text())
    assert [(s.key, s.text) for s in sections] == [
        ("bench_cpu-smollm2-as-source-int8-amd-avx512", "new"),
        ("bench_cpu-smollm2-as-source-int8-intel-avx512", "intel-avx512"),
    ]


def test_an_unclaimed_key_goes_to_scratch(pages, tmp_path):
    headline, *_ = pages
    benchdoc.write_section(headline.path, "bench_ab-whatever", "X")
    assert not headline.path.exists()
    assert keys(tmp_path / "scratch" / "bench_ab-whatever.md") == ["bench_ab-whatever"]


def test_another_document_keeps_its_text(pages, tmp_path):
    doc = tmp_path / "quantization.md"
    doc.write_text("# Quantization\n\nprose\n")
    benchdoc.write_section(doc, "bench_fidelity-smollm2", "KL")
    benchdoc.write_section(doc, "bench_fidelity-smollm2", "KL again")
    text = doc.read_text()
    assert text.startswith("# Quantization\n\nprose\n")
    assert "KL again" in text and "KL\n" not in text


@pytest.mark.parametrize(
    ("vendor", "family", "flags", "label"),
    [
        ("AuthenticAMD", "25", "avx2 avx512f", "amd-avx512"),
        ("AuthenticAMD", "26", "avx2 avx512f", "amd-avx512-zen5"),
        ("AuthenticAMD", "26", "avx2", "amd-avx2"),
        ("GenuineIntel", "6", "avx2 avx512f", "intel-avx512"),
    ],
)
def test_the_cpu_class_tells_zen5_from_zen4(monkeypatch, vendor, family, flags, label):
    """Each class is a key of its own, and the pages claim the sections of every class."""
    fields = {"Vendor ID": vendor, "CPU family": family, "Flags": f"fma {flags}"}
    monkeypatch.setattr(benchdoc, "lscpu_fields", lambda: fields)
    assert benchdoc.cpu_class() == label
    assert benchdoc.page_of(f"bench_cpu-smollm2-as-source-int8-{label}") is benchdoc.HEADLINE
    for pair in ("smollm2", "qwen-pair", "smollm2-varied"):
        assert benchdoc.page_of(f"bench_auto-{pair}-{label}") is benchdoc.SERVING
