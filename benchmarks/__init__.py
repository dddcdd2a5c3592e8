"""Throughput benchmarks, installed as ``mcore_rl.benchmarks``; run with ``mcore-rl bench``."""
