"""MCP (Model Context Protocol): the servers of `--mcp-config`, kept connected with the
official `mcp` SDK, and the calls pippin makes to their tools for the model."""
