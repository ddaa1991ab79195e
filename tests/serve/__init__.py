"""Tests of dualpace.serve: addresses, status mapping, server plumbing."""
