// 1. A text/plain resource changed 10 times (direct mutations and PUTs
// through the proxy; edits in the middle, at both ends, with multi-byte and
// astral characters, several regions at once): the braid-http client's
// replica equals the origin after every change, versions are the origin's
// ETags and each update's Parents is the previous version.

import { test } from 'node:test'
import { useProxy } from '../lib/harness.js'
import { runSyncScenario } from '../lib/sync.js'
import { spliceText, codePoints } from '../lib/patch.js'

const PATH = '/notes.txt'
const CT = 'text/plain; charset=utf-8'
const INITIAL =
  'Hello, wörld! 👋🏽 The quick brown fox 🦊 jumps over the lazy dog.\n' +
  'Zweite Zeile: Grüße aus Köln. 日本語のテキスト。\n' +
  'Family: 👨‍👩‍👧 flags: 🇫🇷🇯🇵 math: 𝔸𝔹ℂ end.\n'

const ctx = useProxy({ seed: (o) => o.set(PATH, INITIAL, { contentType: CT }) })

// Positions are in code points, computed on the current text.
const at = (s, needle) => {
  const i = s.indexOf(needle)
  if (i < 0) throw new Error(`needle ${needle} not found`)
  return codePoints(s.slice(0, i))
}

const edits = [
  { via: 'direct', note: 'insert in the middle after emoji', edit: (s) => spliceText(s, at(s, 'jumps'), at(s, 'jumps'), '🎉 happily ') },
  { via: 'put', note: 'prepend at the start', edit: (s) => 'Start: ' + s },
  { via: 'direct', note: 'append at the end', edit: (s) => s + 'Fin 🏁\n' },
  { via: 'put', note: 'delete a span containing an emoji', edit: (s) => spliceText(s, at(s, '🦊'), at(s, '🦊') + 2) },
  { via: 'direct', note: 'replace a word with non-ASCII', edit: (s) => spliceText(s, at(s, 'dog'), at(s, 'dog') + 3, 'ñandú') },
  { via: 'put', note: 'astral character at the very beginning', edit: (s) => '𝄞' + s },
  { via: 'direct', note: 'delete the last characters (emoji + newline)', edit: (s) => spliceText(s, codePoints(s) - 3, codePoints(s)) },
  { via: 'put', note: 'replace inside a ZWJ sequence', edit: (s) => spliceText(s, at(s, '👩'), at(s, '👩') + 1, '🧑') },
  { via: 'direct', note: 'two regions at once (start and end)', edit: (s) => '¡' + spliceText(s, codePoints(s) - 4, codePoints(s) - 1, 'END') },
  { via: 'put', note: 'three scattered edits', edit: (s) => spliceText(spliceText(spliceText(s, at(s, 'Köln'), at(s, 'Köln') + 4, 'Zürich'), at(s, 'Zweite'), at(s, 'Zweite') + 6, 'Second'), 1, 2, 'X') },
]

test('text/plain: replica follows 10 origin changes exactly', async () => {
  await runSyncScenario(ctx, { path: PATH, contentType: CT, edits })
})
