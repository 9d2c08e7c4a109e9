// Applies Braid range patches to a body.
//
//   unit "text":  ranges count Unicode code points (braid-text's convention)
//   unit "bytes": ranges count bytes
//
// Several patches in one update are absolute ranges against the document as
// it was *before* the update (braid-text's text_apply_patches): they are
// sorted by start and applied left to right with a running offset. They must
// not overlap.

const RANGE = /^\[(\d+):(\d+)\]$/

export function parseRange(range) {
  const m = RANGE.exec(String(range).trim())
  if (!m) throw new Error(`unsupported range ${JSON.stringify(range)} (expected "[a:b]")`)
  const start = Number(m[1])
  const end = Number(m[2])
  if (end < start) throw new Error(`range ${range} ends before it starts`)
  return [start, end]
}

const toBuffer = (x) => (Buffer.isBuffer(x) ? x : Buffer.from(x.buffer, x.byteOffset, x.byteLength))

/**
 * body: Buffer | Uint8Array | string (the document before the update)
 * patches: [{unit, range, content: Uint8Array|Buffer|string}]
 * Returns the new body as a Buffer.
 */
export function applyPatches(body, patches) {
  if (!Array.isArray(patches) || patches.length === 0) throw new Error('applyPatches: no patches')
  const units = new Set(patches.map((p) => p.unit))
  if (units.size !== 1) throw new Error(`applyPatches: mixed units in one update: ${[...units].join(', ')}`)
  const unit = patches[0].unit
  const before = typeof body === 'string' ? Buffer.from(body, 'utf8') : toBuffer(body)

  const items = patches
    .map((p) => {
      const [start, end] = parseRange(p.range)
      const content = typeof p.content === 'string' ? Buffer.from(p.content, 'utf8') : toBuffer(p.content)
      return { start, end, content, range: p.range }
    })
    .sort((a, b) => a.start - b.start || a.end - b.end)

  for (let i = 1; i < items.length; i++)
    if (items[i].start < items[i - 1].end)
      throw new Error(`applyPatches: overlapping ranges ${items[i - 1].range} and ${items[i].range}`)

  if (unit === 'text') {
    const doc = Array.from(before.toString('utf8')) // code points
    const out = []
    let pos = 0
    for (const it of items) {
      if (it.end > doc.length)
        throw new Error(`applyPatches: text range ${it.range} beyond document of ${doc.length} code points`)
      out.push(doc.slice(pos, it.start).join(''), it.content.toString('utf8'))
      pos = it.end
    }
    out.push(doc.slice(pos).join(''))
    return Buffer.from(out.join(''), 'utf8')
  }

  if (unit === 'bytes') {
    const parts = []
    let pos = 0
    for (const it of items) {
      if (it.end > before.length)
        throw new Error(`applyPatches: bytes range ${it.range} beyond document of ${before.length} bytes`)
      parts.push(before.subarray(pos, it.start), it.content)
      pos = it.end
    }
    parts.push(before.subarray(pos))
    return Buffer.concat(parts)
  }

  throw new Error(`applyPatches: unsupported unit ${JSON.stringify(unit)}`)
}

/** Code-point length of a string (what text ranges count). */
export const codePoints = (s) => Array.from(s).length

/** Replace code points [start, end) of `s` with `ins`. */
export function spliceText(s, start, end, ins = '') {
  const cps = Array.from(s)
  return cps.slice(0, start).join('') + ins + cps.slice(end).join('')
}
