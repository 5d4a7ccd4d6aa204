"""What-if: a recording re-scheduled by batchtop's own scheduler under other knobs; diff; tune."""
