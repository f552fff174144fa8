"""The `eagle3` command, a room of its own: steps (the library's steps, one command each, with rich output),
main (the console script: those plus the commands that run through Dagster) and ops (status, resume, the
webserver and its GraphQL). The library (eagle3_core) carries neither rich nor argparse."""
