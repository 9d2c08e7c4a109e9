// 2. The same as test 1 for an application/json resource: patches use the
// text unit (code points) and the replica stays valid, equal JSON.

import { test } from 'node:test'
import assert from 'node:assert/strict'
import { useProxy } from '../lib/harness.js'
import { runSyncScenario } from '../lib/sync.js'

const PATH = '/data.json'
const CT = 'application/json'
const doc = {
  title: 'Grüße 👋',
  items: [
    { id: 1, name: 'apple 🍎', tags: ['fruit', 'rot'] },
    { id: 2, name: 'Brötchen', tags: ['bread'] },
  ],
  meta: { author: 'Zoë', notes: '日本語', count: 2 },
}
const json = (o) => JSON.stringify(o, null, 2) + '\n'

const ctx = useProxy({ seed: (o) => o.set(PATH, json(doc), { contentType: CT }) })

// Each edit is expressed on the parsed document; the origin stores pretty JSON.
const step = (via, note, f) => ({
  via,
  note,
  edit: (s) => {
    const o = JSON.parse(s)
    f(o)
    return json(o)
  },
})

const edits = [
  step('direct', 'change a nested string (emoji)', (o) => (o.items[0].name = 'green apple 🍏')),
  step('put', 'append an array element', (o) => o.items.push({ id: 3, name: 'çà et là', tags: [] })),
  step('direct', 'change a number', (o) => (o.meta.count = 3)),
  step('put', 'insert a key at the start', (o) => {
    const copy = { first: '🥇', ...o }
    for (const k of Object.keys(o)) delete o[k]
    Object.assign(o, copy)
  }),
  step('direct', 'remove an element in the middle', (o) => o.items.splice(1, 1)),
  step('put', 'edit the title (astral chars)', (o) => (o.title = '𝒢𝓇üß𝑒 👋🏾')),
  step('direct', 'add a key at the end', (o) => (o.zzz = { deep: [1, 2, { x: 'ż' }] })),
  step('put', 'tag edits in two places', (o) => {
    o.items[0].tags[1] = 'grün'
    o.zzz.deep[0] = 100
  }),
  step('direct', 'delete a key', (o) => delete o.meta.notes),
  step('put', 'rewrite several values', (o) => {
    o.first = '🏆'
    o.meta.author = 'Zoë & Chloé'
    o.items.push('🍌')
  }),
]

test('application/json: replica follows 10 origin changes exactly', async () => {
  await runSyncScenario(ctx, {
    path: PATH,
    contentType: CT,
    edits,
    check: (text) => assert.doesNotThrow(() => JSON.parse(text), 'replica is valid JSON'),
  })
})
