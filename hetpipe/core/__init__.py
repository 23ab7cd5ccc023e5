"""Core: pure logic and plain data (config, schedules, WSP, protocol, planning, simulation). No torch, no
processes of its own."""
