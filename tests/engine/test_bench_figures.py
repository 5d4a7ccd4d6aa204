"""The benchmarks' one way to write their section of docs/benchmarks.md."""
from batchtop.engine.bench.figures import publish, write_section


def test_a_section_is_replaced_in_place_or_appended_and_the_others_stay(tmp_path):
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n\nintro\n\n## A\n\nold a\n\n## B\n\nold b\n")
    write_section("## A", "## A\n\nnew a\n", doc)
    write_section("## C", "## C\n\nc", doc)
    write_section("## B", "## B\n\nnew b\n", doc)
    assert doc.read_text() == "# Benchmarks\n\nintro\n\n## A\n\nnew a\n\n## B\n\nnew b\n\n## C\n\nc\n"


def test_the_default_page_is_the_repositorys_docs_benchmarks_md():
    from pathlib import Path

    from batchtop.engine.bench.figures import DOCS
    assert DOCS == Path(__file__).resolve().parents[2] / "docs" / "benchmarks.md"
    assert DOCS.read_text().startswith("# Benchmarks\n")


def test_publish_prints_and_writes_only_when_asked(tmp_path, capsys):
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n\n## A\n\nold a\n")
    assert publish("## A", "## A\n\nnew a\n", write=False, doc=doc) == 0
    assert doc.read_text() == "# Benchmarks\n\n## A\n\nold a\n"
    publish("## A", "## A\n\nnew a\n", write=True, doc=doc)
    assert doc.read_text() == "# Benchmarks\n\n## A\n\nnew a\n"
    assert capsys.readouterr().out == "## A\n\nnew a\n\n" * 2


def test_a_range_that_rounds_to_one_value_is_said_once():
    from batchtop.engine.bench.figures import span
    assert span([4.6, 5.1, 5.4]) == "5 s"
    assert span([4.4, 5.1, 8.0]) == "4-8 s"
    assert span([2, 3], "min") == "2-3 min"
