"""`hsbuild report`: a build's history drawn as one self-contained HTML page, from the event log alone.

`series.collect` reads every figure's series (through the live owner during a run, else the log opened read-only);
`charts` draws them with matplotlib (the `report` extra) as inline SVG; `page` writes the page atomically."""
