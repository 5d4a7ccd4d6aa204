"""The engine benchmark's arithmetic: its floors and the table of where the time goes."""
import pytest

from batchtop.engine.bench.engine import breakdown_table, roofline_floor


def test_roofline_floor_counts_prompts_at_the_gemm_rate_and_each_decode_step_at_its_bound():
    # two prompts of 3 and 5 tokens; outputs of 1 and 3 tokens: decode steps t=1 (1 row), t=2 (1 row)
    seconds = roofline_floor([[0] * 3, [0] * 5], [1, 3], per_layer=10.0, per_head=5.0,
                             gemm=100.0, stream_s=0.1)
    assert seconds == pytest.approx(8 * 10 / 100 + 2 * max(0.1, 15 / 100))
    # with a streaming floor below one row's compute, the compute bound counts
    assert roofline_floor([[0]], [2], 10.0, 5.0, 100.0, stream_s=0.01) == pytest.approx(0.1 + 0.15)


def test_breakdown_table_puts_each_step_in_its_kind_against_its_own_roofline():
    # prompt tokens: prompt-carrying, whatever its rows
    records = [(100, 2, 4.0), (8, 8, 1.0), (1, 1, 1.0), (9, 9, 2.0), (16, 16, 2.0), (17, 17, 3.0),
               (33, 33, 5.0)]
    rows = breakdown_table(records, per_layer=1.0, per_head=1.0, gemm=10.0, stream_s=1.0)
    cells = [[cell.strip() for cell in line.split("|")[1:-1]] for line in rows[2:]]
    by_kind = {row[0]: row[1:] for row in cells}
    assert by_kind == {
        "carry prompt tokens": ["1", "4.00", "10.20", "255%"],          # (100 + 2) / 10
        "decode 1-8 rows": ["2", "2.00", "2.60", "130%"],                # max(1, 1.6) + max(1, 0.2)
        "decode 9-16 rows": ["2", "4.00", "5.00", "125%"],               # 1.8 + 3.2
        "decode 17-32 rows": ["1", "3.00", "3.40", "113%"],
        "decode 33+ rows": ["1", "5.00", "6.60", "132%"],
    }
    assert "decode 9-16 rows" not in "".join(breakdown_table([(4, 4, 1.0)], 1.0, 1.0, 10.0, 1.0))


def test_graph_step_table_puts_the_modes_side_by_side():
    from batchtop.engine.bench.engine import graph_step_table
    both = graph_step_table({"on": {1: 0.001, 64: 0.002}, "off": {1: 0.020, 64: 0.022}})
    assert both == ["| decode rows | graphs on: step ms | graphs off: step ms | off / on |",
                    "|---:|---:|---:|---:|", "| 1 | 1.00 | 20.00 | 20.0x |", "| 64 | 2.00 | 22.00 | 11.0x |"]
    assert graph_step_table({"off": {4: 0.0205}}) == ["| decode rows | graphs off: step ms |", "|---:|---:|",
                                                      "| 4 | 20.50 |"]
