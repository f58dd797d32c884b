"""The band stress harness: plan traffic whose single forwards land in a band of sizes
(lo, hi], send it (offline engine or a running server), and judge it from telemetry."""
