// Shared by the pages: the API key (kept in this browser's local storage, sent in the
// Authorization header, never in a URL) and small DOM helpers.
"use strict";

const KEY = "infernix.apiKey";
const $ = id => document.getElementById(id);

function headers() {
  const h = {"Content-Type": "application/json"};
  const k = localStorage.getItem(KEY);
  if (k) h["Authorization"] = "Bearer " + k;
  return h;
}

function el(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined) e.textContent = text;
  return e;
}

function setStatus(text) { $("status").textContent = text ? " · " + text : ""; }

// the key form (#key-form with #api-key): stores what is typed, then calls done()
function wireKeyForm(done) {
  $("key-form").addEventListener("submit", ev => {
    ev.preventDefault();
    localStorage.setItem(KEY, $("api-key").value.trim());
    $("api-key").value = "";
    done();
  });
}
