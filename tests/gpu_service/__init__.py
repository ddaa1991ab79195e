"""Tests of gpu_service."""
