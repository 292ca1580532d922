"""Developer tools beside the package (sm_90a compile reports and checks), not installed."""
