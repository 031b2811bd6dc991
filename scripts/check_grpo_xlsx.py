#!/usr/bin/env python3
"""Open a GRPO output-store XLSX export with openpyxl and check its layout.

Run by crates/training/tests/grpo_output_store.rs (ignored test `xlsx_opens_with_openpyxl`,
which writes the file from fixed records): sheet `generations` with the header
run, step, group, prompt, completion, reward, advantage, finish_reason, then one column per reward
function, and four rows; sheet `steps` with two rows.

Usage: python3 scripts/check_grpo_xlsx.py FILE.xlsx   (pip install openpyxl)
"""
import sys

import openpyxl

wb = openpyxl.load_workbook(sys.argv[1])
assert wb.sheetnames == ["generations", "steps"], wb.sheetnames
g = wb["generations"]
rows = list(g.iter_rows(values_only=True))
assert list(rows[0]) == ["run", "step", "group", "prompt", "completion", "reward", "advantage", "finish_reason", "length", "xml_format"], rows[0]
assert len(rows) == 5, len(rows)
assert rows[1][4] == "a" and rows[1][5] == 0.25 and rows[1][8] == 0.25 and rows[1][9] is None, rows[1]
assert rows[3][4] == 'ccc\n"quoted"', rows[3]
assert rows[4][5] is None, "unscorable reward: empty cell"
s = list(wb["steps"].iter_rows(values_only=True))
assert len(s) == 3 and s[2][2] == -0.1, s
print(f"{sys.argv[1]}: openpyxl {openpyxl.__version__} reads {len(rows) - 1} generations and {len(s) - 1} steps: ok")
