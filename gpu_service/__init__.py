"""GPU engine daemon: prefills, GPU-resident decodes and Dense Assist for the CPU engine."""
