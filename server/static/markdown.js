// A small Markdown renderer for replies: fenced code, headings, lists, quotes, paragraphs, inline
// code, bold, italics and links. Everything is HTML-escaped first; links keep only http(s) targets,
// and images become links (the page fetches nothing a reply names).
"use strict";

function escapeHtml(s) {
  return s.replace(/[&<>"']/g, c => ({"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;"}[c]));
}

function safeUrl(u) {
  return /^https?:\/\//i.test(u) ? u : null;   // u is already escaped (no quotes left in it)
}

function emphasis(s) {
  s = s.replace(/\*\*([^*]+)\*\*/g, "<strong>$1</strong>");
  s = s.replace(/(^|[^*\w])\*([^*\n]+)\*(?!\w)/g, "$1<em>$2</em>");
  return s.replace(/(^|\W)_([^_\n]+)_(?!\w)/g, "$1<em>$2</em>");
}

function inlineMd(text) {
  // code spans are taken out first so that nothing inside them is formatted; links become
  // placeholders while emphasis runs, so that it never reaches into an href
  const links = [];
  const hold = html => `\u0000${links.push(html) - 1}\u0000`;
  return text.split(/(`[^`\n]+`)/).map((part, i) => {
    if (i % 2) return "<code>" + escapeHtml(part.slice(1, -1)) + "</code>";
    let s = escapeHtml(part.replace(/\u0000/g, ""));
    s = s.replace(/!\[([^\]]*)\]\(([^)\s]+)\)/g, (m, alt, url) => {
      const u = safeUrl(url);
      return u ? hold(`<a href="${u}" target="_blank" rel="noopener noreferrer" class="image-link">[image: ${alt || u}]</a>`) : m;
    });
    s = s.replace(/\[([^\]]+)\]\(([^)\s]+)\)/g, (m, label, url) => {
      const u = safeUrl(url);
      return u ? hold(`<a href="${u}" target="_blank" rel="noopener noreferrer">${emphasis(label)}</a>`) : m;
    });
    return emphasis(s).replace(/\u0000(\d+)\u0000/g, (m, k) => links[+k]);
  }).join("");
}

function renderMarkdown(src) {
  const out = [];
  const lines = src.replace(/\r\n/g, "\n").split("\n");
  let para = [], list = null;
  const flushPara = () => { if (para.length) { out.push("<p>" + para.map(inlineMd).join("<br>") + "</p>"); para = []; } };
  const flushList = () => { if (list) { out.push(`<${list.tag}>` + list.items.map(t => "<li>" + inlineMd(t) + "</li>").join("") + `</${list.tag}>`); list = null; } };
  for (let i = 0; i < lines.length; i++) {
    const line = lines[i];
    const fence = line.match(/^\s*```\s*([\w+.-]*)\s*$/);
    if (fence) {                          // a code block runs to its closing fence (or the reply's end)
      flushPara(); flushList();
      const body = [];
      for (i++; i < lines.length && !/^\s*```\s*$/.test(lines[i]); i++) body.push(lines[i]);
      const lang = fence[1] ? ` data-lang="${escapeHtml(fence[1])}"` : "";
      out.push(`<pre class="code"${lang}><code>` + escapeHtml(body.join("\n")) + "</code></pre>");
      continue;
    }
    const h = line.match(/^(#{1,6})\s+(.*)$/);
    const li = line.match(/^\s*(?:([-*+])|(\d+)[.)])\s+(.*)$/);
    if (h) {                              // # -> h3 ... (the page's own headings come first)
      const n = Math.min(6, h[1].length + 2);
      flushPara(); flushList(); out.push(`<h${n}>` + inlineMd(h[2]) + `</h${n}>`);
    }
    else if (li) {
      flushPara();
      const tag = li[1] ? "ul" : "ol";
      if (list && list.tag !== tag) flushList();
      if (!list) list = {tag, items: []};
      list.items.push(li[3]);
    } else if (/^>\s?/.test(line)) { flushPara(); flushList(); out.push("<blockquote>" + inlineMd(line.replace(/^>\s?/, "")) + "</blockquote>"); }
    else if (!line.trim()) { flushPara(); flushList(); }
    else { flushList(); para.push(line); }
  }
  flushPara(); flushList();
  return out.join("");
}
