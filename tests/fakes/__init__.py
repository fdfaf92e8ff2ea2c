"""Fakes of what the code under test talks to, for tests that need no model or process."""
