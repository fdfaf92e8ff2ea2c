"""The daemon: app factory, scheduler, runner handles."""
