"""The `oomguard` command line: its arguments (parser), the commands (main; those on
checkpoints in storecommands, what they share in commandbase), output for people (progress; an
event's text is observe/rendering.py), `restore --wait` (restorewait), `doctor`, and
`install-units`."""
