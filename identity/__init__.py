"""Identity and signing primitives shared by nodes, coordinator and CLI; imports neither side."""
