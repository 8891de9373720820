"""msgspec Structs shared by every basertd process: the Link W envelope and catalog, the tick plan
and events (field for field with the tick ABI), the capability record, the client and control APIs,
and the ABI's status / fault / finish / ... codes (DESIGN.md "Layout", "Link W")."""
