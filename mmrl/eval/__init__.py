"""``mmrl eval``: benchmark evaluation of generators and vision-language models.

:mod:`mmrl.eval.benchmarks` holds the typed, validated loaders for the shipped benchmark files
(``assets/benchmarks/``) and for the files a user supplies (DPG-Bench's ``dpg_bench.csv``, HPSv2's
prompt JSONs).
"""
