"""Auto-tuning with MetaSchedule: search a schedule's knobs, keep every measurement, reuse the best.

    tune(spec, "cpu", trials=64)          measure; records go to the user's log directory
    tvmattn.compile(spec, "cpu")          then uses the best record (see `lookup`)

Modules: `records` (the stored format), `lookup` (which record a compile uses), `space` (the knob
grid), `search` (the MetaSchedule search strategy), `measure` (builder and runners, local or RPC),
`progress`, `tuner` (the driver).
"""
