"""The host side of the worker pool: launching, the authenticated channel, worker logs."""
